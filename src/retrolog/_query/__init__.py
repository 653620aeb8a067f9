"""Reading the store: the dataframe view, read-only SQL, the runs list.

Private (underscored) because a subpackage named ``query`` would be bound as
``retrolog.query`` on import, shadowing the public ``query()`` function.
"""
