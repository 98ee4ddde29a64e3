"""The only code that knows the on-disk layout of what training leaves behind.

- :mod:`~minimind_ray.store.pth`: MiniMind ``.pth`` state dicts (save, load).
- :mod:`~minimind_ray.store.checkpoint`: the checkpoint directory layout, its typed
  :class:`~minimind_ray.store.checkpoint.CheckpointMeta`, verify, newest-complete, prune.
- :mod:`~minimind_ray.store.weights`: weights from any source a user may name (a ``.pth``,
  a checkpoint or run directory, a storage URI), verified once per load.
- :mod:`~minimind_ray.store.merge_lora_verb`: ``minimind-ray merge-lora``.

No Ray here: the Ray layer (``minimind_ray/raytrain``) hands this package plain paths.
"""
