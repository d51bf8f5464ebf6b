"""Piecewise CUDA graphs: steps that no full graph can replay (prompt chunks, mixed batches) with everything but
the attention cores replayed from graphs.

Upstream splits the compiled model at its attention ops and captures the pieces between them; this model's
forward is written in those pieces already (`KimiK3Model.begin`, `between`, `end`, with each layer's core in
`attend`), so they are captured here directly. A step then is: the `begin` graph, then per layer its core run
eagerly (it is the only part that reads the metadata, the caches and the recurrent states, and the KDA prefill
kernels take host decisions no graph could hold) and the graph of the piece after it. An eager step is host
bound (hundreds of kernel launches for a few milliseconds of GPU work, docs/performance.md); the pieces turn
most of those into a graph launch per layer.

Pieces read and write persistent buffers, one per tensor that crosses a core (the residual stream h, the normed
input x, each kind of core's inputs and its output), sized for the largest capture; every capture size's graphs
use their first rows. A step of T tokens runs in the graphs of the smallest size >= T: the pieces compute the
padding rows too (rows are independent there), the cores see only the step's T rows. Graphs share the full
graphs' memory pool: pieces run one after another, so their temporaries may share memory.
"""
from __future__ import annotations

import functools

import torch

# Token counts captured by default: past 512 tokens a step's GPU work outweighs its launches (upstream stops its
# default capture sizes at 512 too), and coarse steps suffice where padding rows cost little.
PIECEWISE_SIZES = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512)


def piecewise_sizes(max_num_batched_tokens: int) -> list[int]:
    """Capture sizes, ascending, up to the token budget (which is captured itself when under 512)."""
    sizes = [n for n in PIECEWISE_SIZES if n <= max_num_batched_tokens]
    if max_num_batched_tokens < PIECEWISE_SIZES[-1] and max_num_batched_tokens not in sizes:
        sizes.append(max_num_batched_tokens)
    return sizes


class PiecewiseCUDAGraphs:
    """The pieces of `model` (a KimiK3Model) captured at `sizes`, reading token ids from `input_ids` (a persistent
    device buffer at least max(sizes) long), in `graphs` (CUDAGraphRunner: capture, replay, one pool)."""

    def __init__(self, model, input_ids: torch.Tensor, graphs, sizes: list[int]) -> None:
        self.model, self.input_ids, self.graphs = model, input_ids, graphs
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.kinds = ["kda" if layer.is_kda else "mla" for layer in model.layers]
        self.buffers: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        # Per layer, its core's (input buffers, output buffer): looked up once, not by name at every step.
        self.layer_buffers: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]] = []

    def capture(self, size: int) -> None:
        """Captures every piece at `size` tokens (capture the largest first: its buffers are sized by it)."""
        if not self.buffers:
            self._allocate(self.max_size)
        for piece in range(len(self.model.layers) + 1):
            self.graphs.capture(("piecewise", size, piece), functools.partial(self._piece, size, piece))

    def run(self, num_tokens: int, attn_metadata) -> torch.Tensor:
        """Last-layer hidden states [num_tokens, D] of the step whose token ids are in `input_ids`; a view of a
        persistent buffer that the next step overwrites."""
        size = next(n for n in self.sizes if n >= num_tokens)
        self.graphs.replay(("piecewise", size, 0))
        for i, (in_bufs, out_buf) in enumerate(self.layer_buffers):
            inputs = tuple(buf[:num_tokens] for buf in in_bufs)
            out_buf[:num_tokens].copy_(self.model.attend(i, inputs, attn_metadata))
            self.graphs.replay(("piecewise", size, i + 1))
        return self.buffers["h"][:num_tokens]

    def _piece(self, size: int, piece: int) -> None:
        """Piece 0 is `begin`; piece i+1 runs after layer i's core: `between(i)`, or `end` after the last one."""
        b = self.buffers
        if piece == 0:
            h, x, inputs = self.model.begin(self.input_ids[:size])
        else:
            i = piece - 1
            y, h_in, x_in = self.layer_buffers[i][1][:size], b["h"][:size], b["x"][:size]
            if i == len(self.kinds) - 1:
                b["h"][:size].copy_(self.model.end(y, h_in, x_in))
                return
            h, x, inputs = self.model.between(i, y, h_in, x_in)
        b["h"][:size].copy_(h)
        b["x"][:size].copy_(x)
        for buf, t in zip(self.layer_buffers[piece][0], inputs, strict=True):
            buf[:size].copy_(t)

    def _allocate(self, size: int) -> None:
        """Buffers shaped as one eager pass at `size` tokens makes them. Zeros, not empty: padding rows run through
        the routers, and a NaN there must not pick experts."""
        model, b = self.model, self.buffers
        h, x, _ = model.begin(self.input_ids[:size])
        b["h"], b["x"] = torch.zeros_like(h), torch.zeros_like(x)
        for kind in set(self.kinds):
            layer = model.layers[self.kinds.index(kind)].self_attn
            b[f"{kind}_in"] = tuple(torch.zeros_like(t) for t in layer.project(x))
            # The core's output: what the piece after it reads (o_proj's input, per head for MLA).
            out_shape = (size, layer.o_proj.in_features) if kind == "kda" else (size, layer.num_heads,
                                                                                  layer.v_head_dim)
            b[f"{kind}_out"] = torch.zeros(out_shape, dtype=x.dtype, device=x.device)
        self.layer_buffers = [(b[f"{kind}_in"], b[f"{kind}_out"]) for kind in self.kinds]
