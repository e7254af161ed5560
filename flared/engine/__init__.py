"""The engine core: scheduling, request state, and page/row pools. Pure CPU.

Nothing in this package imports torch or numpy; page ids, row ids and token ids are ints, so
the whole package is testable without a GPU. The runner consumes `plan.StepPlan` and answers
with `plan.StepResult`; those two objects are the only things that cross the boundary.
"""
