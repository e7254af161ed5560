"""The engine core: scheduling, request state, page/row/snapshot pools and the prefix cache.
Pure CPU.

Nothing in this package imports torch or numpy; page ids, row ids, snapshot ids, token ids and
prefix digests are ints, so the whole package is testable without a GPU. The runner consumes
`plan.StepPlan` and answers with `plan.StepResult`; those two objects are the only things that
cross the boundary (checkpoint restores, resume sampling and snapshots included).
"""
