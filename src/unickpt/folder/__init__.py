"""The on-storage protocol of one checkpoint folder (what is in it, who may write or delete what).

  ``publish``  atomic publication of small objects: rename-publish or put-publish, picked from
               the backend's capabilities (the metadata commit, ``latest`` pointers, locks);
  ``target``   the storage of a checkpoint path and role; what every rank must pass alike;
  ``markers``  which names in a folder are unickpt's (metadata, lock, data markers, data files);
  ``lock``     the save lock (``lock_owner``: its holder record and staleness);
  ``probe``    the committed metadata, read one way; what a folder without one is;
  ``cleanup``  deleting unickpt's own files only: stale data after a commit, a whole checkpoint.
  ``state``    what a checkpoint folder is (complete, incomplete, damaged, ...: ``unickpt ls``'s
               words) and every checkpoint below a folder;
  ``files``    whether a checkpoint's data files are all there: one rule for load, verify, the
               manager, retention (complete: at least the recorded bytes) and the commit (exact).
The save and load engines, ``CheckpointManager``, tiering, the integrations and ``ops`` use
these; nothing here runs a pipeline.
"""
