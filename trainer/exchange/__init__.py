"""The exchange between trainer workers and the holder: how a gradient travels and how
parameters come back.

:mod:`.handle` (a worker's handle on the holder: in-process, the direct channel, or the
actor's RPC, every wait with a deadline and a liveness check), :mod:`.channel` (the direct
TCP/local-socket channel: protocol, server on the holder, client in the worker),
:mod:`.admission` (connections waiting to authenticate), :mod:`.reconnect` (a worker's way
back onto the channel), :mod:`.shared` (shared memory on one host) and :mod:`.buckets`
(pushing a gradient while backward still computes it).
"""
