"""Prepared components: the smallest modules a recipe replaces, plus in-graph sampling."""
