"""Everything that touches a process group: compressed gradient averaging as a DDP comm hook.

:mod:`.hook` registers it (``register_compression``) and holds the hook body; :mod:`.state` its
checkpointable state; :mod:`.reduce` averages one bucket, route by route (:mod:`.bucket`), with
PowerSGD's two all-reduces in :mod:`.powersgd` and embedding rows in :mod:`.rowblocks`;
:mod:`.autorun` carries ``auto``'s decision out; :mod:`.torch_hooks` installs PyTorch's own
hooks (the anchors); :mod:`.deferred` binds the hook lazily (Lightning); :mod:`.local` keeps
gradients local for optimizers that communicate; :mod:`.callbacks` runs future callbacks with
the rank's thread count.
"""
