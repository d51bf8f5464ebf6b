"""ParallelConfig: tensor and expert parallelism, over one node or several (docs/parallelism.md)."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.config.utils import is_int, require


@dataclass(slots=True)
class ParallelConfig:
    """Tensor parallelism (`-tp`), over `nnodes` hosts joined at master_addr:master_port (torch.distributed's
    TCP rendezvous); `headless`: this node runs worker ranks only (docs/parallelism.md)."""
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port, on one node
    headless: bool = False

    def __post_init__(self) -> None:
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        require(is_int(tp) and tp >= 1, "--tensor-parallel-size", tp, "an integer >= 1")
        require(is_int(nnodes) and nnodes >= 1 and tp % nnodes == 0, "--nnodes", nnodes,
                 f"an integer >= 1 that divides --tensor-parallel-size ({tp}): each node runs as many ranks")
        require(is_int(self.node_rank) and 0 <= self.node_rank < nnodes, "--node-rank", self.node_rank,
                 f"in [0, --nnodes={nnodes})")
        require(is_int(self.master_port) and 0 <= self.master_port < 65536 and (nnodes == 1 or self.master_port),
                 "--master-port", self.master_port, "a TCP port (set on every node when --nnodes > 1)")
        require(not self.headless or self.node_rank > 0, "--headless", self.headless,
                 "only on nodes other than --node-rank 0 (which runs the engine)")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes
