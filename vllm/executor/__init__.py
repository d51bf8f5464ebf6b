"""More than one rank: tp_engine.py (rank 0's engine, which starts the other ranks and hands them each step's
inputs), tp_worker.py (the other ranks' process). docs/parallelism.md has the design."""
