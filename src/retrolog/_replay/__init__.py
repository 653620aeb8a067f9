"""Replay: answer new log statements for past runs by re-executing them from checkpoints.

``statements`` finds where requested statements sit relative to the loops,
``plan`` turns that and the recorded timing profile into a plan and an estimate.
See docs/replay-planning.md.

Private (underscored) because a subpackage named ``replay`` would be bound as
``retrolog.replay`` on import, shadowing the public ``replay()`` function.
"""
