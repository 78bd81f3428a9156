"""The exchange between trainer workers and the holder: how a gradient travels and how
parameters come back.

:mod:`.handle` (a worker's handle on the holder: in-process, the direct channel, or the
actor's RPC, every wait with a deadline and a liveness check), the direct TCP/local-socket channel
(:mod:`.protocol` its wire, :mod:`.server` and :mod:`.transfer` the holder's end,
:mod:`.client` and :mod:`.link` a worker's),
:mod:`.admission` (connections waiting to authenticate), :mod:`.reconnect` (a worker's way
back onto the channel), :mod:`.contact` (the holder's end of the channel, opened on first
use), :mod:`.shared` (shared memory on one host), :mod:`.buckets` (pushing a gradient while
backward still computes it) and :mod:`.sharded` (the driver's and a worker's view of a holder
in shards).
"""
