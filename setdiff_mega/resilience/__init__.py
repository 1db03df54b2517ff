"""Fault tolerance (docs/architecture.md, docs/guide/multinode.md): per-rank heartbeats watched by a
process outside the trainer (:mod:`.heartbeat`, :mod:`.watchdog`), the restart supervisor behind
``launch.sh --max-restarts`` (:mod:`.supervisor`), per-rank step-time statistics (:mod:`.straggler`) and
the fault injection the chaos test drives (:mod:`.chaos`). Importing this package imports nothing heavy
(the watchdog process runs on the standard library alone)."""
