"""Persistent host/device buffers that one step's inputs are written into (never reallocated).

Host copies are numpy views of (pinned, on CUDA) CPU tensors; each step writes them and queues one copy per
buffer to the device (the block table: only the entries the step adds). Graph capture relies on the device
tensors never moving.
"""
from __future__ import annotations

import dataclasses
import operator

import numpy as np
import torch

from vllm.attention.backend import CommonAttentionMetadata
from vllm.core.kv_cache_manager import NULL_STATE_SLOT, KVCacheManager
from vllm.core.scheduler import SchedulerOutput
from vllm.core.sentinels import DEVICE_DRAFT_TOKEN_ID
from vllm.utils import async_tensor_h2d
from vllm.worker.in_flight_fill import FILL_FIELDS, DeviceFills, FillTargets, InFlightStep, fill_from_step


class CpuGpuBuffer:
    """A host buffer and its device twin. Separate storage even on a CPU device, so the device side can be
    re-cut (trim_on_device) or padded (pad_for_graph) without touching the host view, exactly as on a GPU."""

    def __init__(self, shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self._bind(torch.zeros(shape, dtype=dtype, pin_memory=pin), torch.zeros(shape, dtype=dtype, device=device))

    def _bind(self, cpu: torch.Tensor, gpu: torch.Tensor) -> None:
        self.cpu, self.np, self.gpu = cpu, cpu.numpy(), gpu
        # (host, device) views of the first n rows by n: each step takes the same few, and slicing a tensor is
        # microseconds of host time on every step
        self._prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def row(self, i: int) -> CpuGpuBuffer:
        """Row i of a 2-D buffer as a buffer of its own, sharing the storage (host, device and numpy views)."""
        view = object.__new__(CpuGpuBuffer)
        view._bind(self.cpu[i], self.gpu[i])
        return view

    def prefix(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(host, device) views of the first n rows."""
        views = self._prefixes.get(n)
        if views is None:
            views = self._prefixes[n] = (self.cpu[:n], self.gpu[:n])
        return views

    def copy_to_device(self, n: int) -> torch.Tensor:
        cpu, gpu = self.prefix(n)
        gpu.copy_(cpu, non_blocking=True)
        return gpu


class InputBatch:
    def __init__(self, max_num_reqs: int, max_num_tokens: int, max_blocks_per_req: int, block_size: int,
                 device: torch.device, slots_per_request: int = 1, speculating: bool | None = None) -> None:
        self.block_size = block_size
        # Verify rows (draft ids, accepted counts) exist; checkpoint columns (2-D state slots) only without RecoverSSM.
        self.spec = slots_per_request > 1 if speculating is None else speculating
        self.columns = slots_per_request > 1
        # The per-token buffers are the rows of one, so that trim_on_device re-cuts them in one gather.
        self.token_rows = CpuGpuBuffer((4, max_num_tokens), torch.int64, device)
        self.input_ids = self.token_rows.row(0)
        # The step's tokens as scheduled, placeholder drafts still -1: the rejection sampler's draft ids (the
        # greedy verification of the decode tail reads them too).
        self.draft_ids = self.token_rows.row(1)
        self.positions = self.token_rows.row(2)
        self.slot_mapping = self.token_rows.row(3)
        self.query_start_loc = CpuGpuBuffer(max_num_reqs + 1, torch.int32, device)
        self.seq_lens = CpuGpuBuffer(max_num_reqs, torch.int32, device)
        self.state_indices = CpuGpuBuffer((max_num_reqs, slots_per_request), torch.int32, device)
        self.num_accepted = CpuGpuBuffer(max_num_reqs, torch.int32, device)
        self.num_draft_tokens = torch.zeros(max_num_reqs, dtype=torch.int32)  # host only: row tags
        self.block_table = CpuGpuBuffer((max_num_reqs, max_blocks_per_req), torch.int32, device)
        # Which block list each row holds and how much of it is written, on the host and on the device alike: a
        # row is rewritten only when its request (or its list, after a preemption) changes, else only its new
        # blocks are appended, and only those entries go to the device (a whole table is O(context) per step).
        self.row_lists: list[tuple[str, int] | None] = [None] * max_num_reqs
        self.row_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.new_blocks: list[tuple[int, int, int]] = []  # (row, first column, past the last) to send this step
        self.is_prefilling = torch.zeros(max_num_reqs, dtype=torch.bool)  # host only: request state
        self.is_prefilling_np = self.is_prefilling.numpy()
        # The in-flight fill's descriptor rows (in_flight_fill.FillField), uploaded like the step's inputs.
        self.fill_desc = CpuGpuBuffer((max_num_reqs, FILL_FIELDS), torch.int64, device)
        self._fill_targets: FillTargets | None = None  # the buffers the fill writes, made at its first use
        # Recorded behind each step's host-to-device copies: the host buffers are rewritten only after they
        # ran, which matters once a step is prepared while the one before may still be queued.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        # The offsets and state slots last sent to the device while the device still holds them (a trim or a
        # dummy step rewrites them), else None: a step whose rows keep them sends them no more.
        self._sent_rows: tuple[np.ndarray, np.ndarray] | None = None
        # The step's metadata views by (requests, tokens), see _metadata.
        self._metadata_views: dict[tuple[int, int], tuple] = {}
        # The requests of the last step if it was one-token decodes without speculation (see _continues_decode),
        # else None.
        self._last_decode_rows: list | None = None
        # pad_for_graph's arguments while the device buffers still hold that padding past the step's rows (a step
        # of the same rows and tokens writes none of it), else None.
        self._padding: tuple[int, int, int, int] | None = None

    def prepare(self, out: SchedulerOutput, kv: KVCacheManager,
                in_flight: InFlightStep | None = None) -> CommonAttentionMetadata:
        """Writes the step's token ids, positions and cache indices; returns the step's common metadata. What the
        host does not know yet is on the device in `in_flight` (the latest launched step's outputs) and is
        copied there: a row's newest token, its DSpark drafts and, after a verify row whose results are not back,
        the row's true start (the host placed it as if every draft in flight were accepted)."""
        if self._copied is not None:
            self._copied.synchronize()  # never recorded yet: returns at once
        bs = self.block_size
        scheduled = out.scheduled
        n_reqs = len(scheduled)
        reqs = [s.request for s in scheduled]
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, n_reqs)
        lens = np.fromiter((s.num_tokens for s in scheduled), np.int64, n_reqs)
        continues = self._continues_decode(scheduled, reqs, starts, lens)
        qsl, seq_lens = self.query_start_loc.np, self.seq_lens.np
        if not continues:
            qsl[0] = 0
            qsl[1:n_reqs + 1] = np.cumsum(lens)
        seq_lens[:n_reqs] = starts + lens
        T = int(qsl[n_reqs])
        if self._padding is not None and self._padding[:2] != (n_reqs, T):
            self._padding = None
        fills = self._write_tokens(scheduled, reqs, starts, T, continues)
        row_of_token = np.repeat(np.arange(n_reqs), lens)
        positions = self.positions.np[:T]
        positions[:] = np.arange(T) + np.repeat(starts - qsl[:n_reqs], lens)
        self.new_blocks = []
        rids = [r.request_id for r in reqs]
        # Continuing, only a row whose token opens a block can have been given one; the check after it falls
        # back to every row should a row's table still lack its token's block.
        rows = np.flatnonzero(starts % bs == 0).tolist() if continues else range(n_reqs)
        self._append_blocks(kv, rids, rows)
        if continues and kv.needs_blocks and not (self.row_blocks[:n_reqs] * bs > starts).all():
            self._append_blocks(kv, rids, range(n_reqs))
        if not continues:
            # Per-row columns in one numpy write each: an element write into a tensor costs microseconds.
            self.state_indices.np[:n_reqs] = [kv.state_slots(rid) for rid in rids]
            self.num_accepted.np[:n_reqs] = [r.num_accepted_tokens for r in reqs]
            self.num_draft_tokens.numpy()[:n_reqs] = [s.num_draft_tokens for s in scheduled]
            self.is_prefilling_np[:n_reqs] = [s.is_prefilling for s in scheduled]
        if kv.needs_blocks:
            block_ids = self.block_table.np[row_of_token, positions // bs].astype(np.int64)
            self.slot_mapping.np[:T] = block_ids * bs + positions % bs
        else:
            self.slot_mapping.np[:T] = -1
        self._copy_to_device(n_reqs, T, rows_changed=not continues)
        if fills:
            if self._fill_targets is None:
                self._fill_targets = FillTargets(
                    self.input_ids.gpu, self.draft_ids.gpu, self.positions.gpu, self.slot_mapping.gpu,
                    self.seq_lens.gpu, self.num_accepted.gpu, self.block_table.gpu, self.block_size, kv.needs_blocks)
            fill_from_step(fills, in_flight, self._fill_targets, self.fill_desc)
        self._record_copies()
        decode_only = T == n_reqs and not self.spec and not self.is_prefilling_np[:n_reqs].any()
        self._last_decode_rows = reqs if decode_only else None
        return self._metadata(n_reqs, T, int(lens.max()) if n_reqs else 0,
                              int(seq_lens[:n_reqs].max()) if n_reqs else 0, freeze_host=False)

    def _continues_decode(self, scheduled: list, reqs: list, starts: np.ndarray, lens: np.ndarray) -> bool:
        """Whether this step is the last one advanced by a token: the same requests in the same rows, each
        decoding one token, after a step of one-token decodes. Its offsets, state slots and row flags then stand
        as they are on the host and on the device, so the step writes only what moved (as upstream's persistent
        batch does), instead of a Python pass per request over each of them."""
        last = self._last_decode_rows
        return (last is not None and len(last) == len(reqs) and all(map(operator.is_, reqs, last))
                and bool((lens == 1).all()) and np.array_equal(starts, self.seq_lens.np[:len(reqs)])
                and not any(s.is_prefilling for s in scheduled))

    def _write_tokens(self, scheduled: list, reqs: list, starts: np.ndarray, T: int, continues: bool) -> DeviceFills:
        """Writes the step's token ids (drafts as scheduled, placeholders and device drafts as 0); returns where
        the device must fill in what the host does not have. A continuing step whose every token is in flight
        (async scheduling's steady state) reads no request's tokens."""
        fills = DeviceFills()
        if continues and (starts >= np.fromiter((r.num_tokens for r in reqs), np.int64, len(reqs))).all():
            self.input_ids.np[:T] = 0  # draft ids are read only when speculating, which never continues
            fills.rows = [(pos, r.request_id, pos, pos, 1, 0, -1, 0) for pos, r in enumerate(reqs)]
            return fills
        tokens: list[int] = []
        for r, (s, start) in enumerate(zip(scheduled, starts.tolist())):
            drafts, req = s.draft_token_ids, s.request
            # Drafts in flight placed the row as if all were accepted; its tokens are those of the row placed as
            # if all were rejected, the least a step in flight can emit.
            first_token = len(tokens)
            first = start - s.num_spec_in_flight
            end = first + s.num_tokens - len(drafts)
            known = min(end, req.num_tokens)
            tokens += req.token_ids_slice(first, known)
            anchor = -1
            if end > known:
                assert end == known + 1, "only the last sampled token can still be in flight"
                anchor = len(tokens)
                tokens.append(0)
            device_drafts = len(drafts) if drafts and drafts[0] == DEVICE_DRAFT_TOKEN_ID else 0
            if anchor >= 0 or device_drafts or s.num_spec_in_flight:
                fills.rows.append((r, req.request_id, anchor, first_token, s.num_tokens, s.num_spec_in_flight,
                                   len(tokens), device_drafts))
            tokens += drafts
        self.draft_ids.np[:T] = tokens
        np.maximum(self.draft_ids.np[:T], 0, out=self.input_ids.np[:T])  # a placeholder runs as token 0
        return fills

    def _append_blocks(self, kv: KVCacheManager, rids: list[str], rows) -> None:
        """Brings the table rows up to date with their requests' block lists: a row whose list is the one it
        holds gets only the blocks added since, any other row is rewritten; the entries written are queued for
        the device (new_blocks)."""
        table, row_lists, row_blocks = self.block_table.np, self.row_lists, self.row_blocks
        for r in rows:
            rid = rids[r]
            blocks = kv.block_ids(rid)
            key = (rid, kv.block_list_id(rid))
            start = row_blocks[r] if row_lists[r] == key else 0
            if len(blocks) > start:
                table[r, start:len(blocks)] = blocks[start:]
                self.new_blocks.append((r, start, len(blocks)))
                row_lists[r], row_blocks[r] = key, len(blocks)

    def _copy_to_device(self, num_reqs: int, num_tokens: int, rows_changed: bool = True) -> None:
        """One host-to-device copy per buffer, of the rows the step uses (the draft ids and accepted counts only
        when speculating: nothing reads them otherwise; the offsets and state slots only when `rows_changed`,
        since a continuing decode step leaves them as the device holds them)."""
        spec_reqs, spec_tokens = ((self.num_accepted,), (self.draft_ids,)) if self.spec else ((), ())
        if rows_changed:
            qsl, slots = self.query_start_loc.np[:num_reqs + 1], self.state_indices.np[:num_reqs]
            sent = self._sent_rows
            if sent is None or not (np.array_equal(sent[0], qsl) and np.array_equal(sent[1], slots)):
                self.query_start_loc.copy_to_device(num_reqs + 1)
                self.state_indices.copy_to_device(num_reqs)
                self._sent_rows = (qsl.copy(), slots.copy())
        for buf in (self.seq_lens, *spec_reqs):
            buf.copy_to_device(num_reqs)
        if self.new_blocks:
            rows = np.concatenate([np.full(e - b, r) for r, b, e in self.new_blocks])
            cols = np.concatenate([np.arange(b, e) for _, b, e in self.new_blocks])
            index = async_tensor_h2d(np.stack([rows, cols, self.block_table.np[rows, cols]]), torch.int64,
                                     self.block_table.gpu.device)
            self.block_table.gpu[index[0], index[1]] = index[2].to(torch.int32)
        for buf in (self.input_ids, self.positions, self.slot_mapping, *spec_tokens):
            buf.copy_to_device(num_tokens)

    def _record_copies(self) -> None:
        """Marks the end of the step's host-to-device copies (the next prepare waits for it)."""
        if self._copied is not None:
            self._copied.record()

    def _metadata(self, num_reqs: int, num_tokens: int, max_query_len: int, max_seq_len: int,
                  freeze_host: bool) -> CommonAttentionMetadata:
        """The step's metadata over the buffers' first rows: device tensors are views of the persistent device
        buffers; host tensors are views too, or frozen copies (`freeze_host`, for a graph's capture). The views
        are made once per shape."""
        views = self._metadata_views.get((num_reqs, num_tokens))
        if views is None:
            slots, slots_cpu = self.state_indices.gpu[:num_reqs], self.state_indices.cpu[:num_reqs]
            if not self.columns:  # one slot per request: the 1-D layout every KDA backend takes
                slots, slots_cpu = slots[:, 0], slots_cpu[:, 0]
            views = self._metadata_views[(num_reqs, num_tokens)] = (
                self.query_start_loc.gpu[:num_reqs + 1], self.query_start_loc.cpu[:num_reqs + 1],
                self.seq_lens.gpu[:num_reqs], self.seq_lens.cpu[:num_reqs], self.block_table.gpu[:num_reqs],
                self.slot_mapping.gpu[:num_tokens], self.is_prefilling[:num_reqs], slots, slots_cpu,
                self.num_draft_tokens[:num_reqs], self.num_accepted.gpu[:num_reqs] if self.spec else None)
        qsl, qsl_cpu, seq_lens, seq_lens_cpu, block_table, slot_mapping, prefilling, slots, slots_cpu, drafts, \
            accepted = views
        if freeze_host:
            qsl_cpu, seq_lens_cpu, prefilling, slots_cpu, drafts = (
                t.clone() for t in (qsl_cpu, seq_lens_cpu, prefilling, slots_cpu, drafts))
        return CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl_cpu, seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu,
            num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=max_query_len, max_seq_len=max_seq_len,
            block_table=block_table, slot_mapping=slot_mapping, is_prefilling=prefilling, state_indices=slots,
            state_indices_cpu=slots_cpu, num_draft_tokens=drafts, num_accepted_tokens=accepted)

    def fill_for_capture(self, num_reqs: int, num_tokens: int, max_query_len: int) -> None:
        """Harmless inputs for capturing a graph of this shape: tokens spread evenly over requests with no
        cached context, no cache writes, every request on the null state slot."""
        lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
        lens[:num_tokens % num_reqs] += 1
        assert lens.max() <= max_query_len, "a capture shape whose rows exceed its max_query_len"
        self.fill_dummy(lens, np.zeros(num_reqs, dtype=np.int64), np.zeros(num_reqs, dtype=bool))

    def fill_dummy(self, query_lens: np.ndarray, context_lens: np.ndarray, prefilling: np.ndarray) -> None:
        """Harmless inputs of a given shape (a capture, a start-up warm-up step): token 0 everywhere, contexts
        read from block 0, no cache writes, every request on the null state slot."""
        n, T = len(query_lens), int(query_lens.sum())
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1:n + 1] = np.cumsum(query_lens)
        self.seq_lens.np[:n] = context_lens + query_lens
        self.input_ids.np[:T] = 0
        self.positions.np[:T] = (np.arange(T) - np.repeat(self.query_start_loc.np[:n], query_lens)
                                 + np.repeat(context_lens, query_lens))
        self.slot_mapping.np[:T] = -1
        self.block_table.np[:n] = 0
        self.row_lists[:n] = [None] * n  # the next step rewrites these rows
        self._last_decode_rows = None
        self._padding = None
        self._sent_rows = None
        self.new_blocks = []
        self.block_table.copy_to_device(n)
        self.state_indices.np[:n] = NULL_STATE_SLOT
        self.num_accepted.np[:n] = 1
        self.is_prefilling_np[:n] = prefilling
        self._copy_to_device(n, T)
        self._record_copies()

    def dummy_metadata(self, num_reqs: int, num_tokens: int, max_query_len: int,
                       max_seq_len: int) -> CommonAttentionMetadata:
        """An eager step's metadata over what fill_dummy wrote."""
        return self._metadata(num_reqs, num_tokens, max_query_len, max_seq_len, freeze_host=False)

    def graph_metadata(self, num_reqs: int, num_tokens: int, max_query_len: int,
                       max_seq_len: int) -> CommonAttentionMetadata:
        """Metadata for capturing a graph of this shape. Its device tensors are views of buffers that later
        steps refill in place (the replayed kernels read fixed addresses); its host tensors are frozen copies
        of the capture's values, since a graph replays the host decisions it was captured with."""
        return self._metadata(num_reqs, num_tokens, max_query_len, max_seq_len, freeze_host=True)

    def pad_for_graph(self, num_reqs: int, num_tokens: int, graph_reqs: int, graph_tokens: int) -> None:
        """After prepare(): zero-length requests on the null slot and tokens that write nothing, up to a
        captured graph's shape, so its kernels see exactly this batch. A decode loop pads once: its steps leave the
        padding in place."""
        if self._padding == (num_reqs, num_tokens, graph_reqs, graph_tokens):
            return
        self._padding = (num_reqs, num_tokens, graph_reqs, graph_tokens)
        if graph_reqs > num_reqs:
            self.query_start_loc.gpu[num_reqs + 1:graph_reqs + 1] = num_tokens
            self.seq_lens.gpu[num_reqs:graph_reqs] = 0
            self.state_indices.gpu[num_reqs:graph_reqs] = NULL_STATE_SLOT
            self.num_accepted.gpu[num_reqs:graph_reqs] = 1
        if graph_tokens > num_tokens:
            self.slot_mapping.gpu[num_tokens:graph_tokens] = -1

    def trim_on_device(self, common: CommonAttentionMetadata, cpu_lens: list[int],
                       device_lens: torch.Tensor) -> CommonAttentionMetadata:
        """Re-cuts an all-verify step after prepare(): row r keeps its first device_lens[r] scheduled tokens
        (its current token, then drafts), while the host metadata shows cpu_lens, which may differ row by row
        but has the same total. Token ids, draft ids, positions, cache rows and lengths are gathered on the
        device from the scheduled layout; max_query_len stays the scheduled (untrimmed) bound."""
        n = common.num_reqs
        T = sum(cpu_lens)
        assert len(cpu_lens) == n and T <= common.num_actual_tokens
        self._last_decode_rows = None  # the offsets and lengths below no longer describe the scheduled rows
        self._padding = None  # the scheduled tokens past the kept ones are live again next step
        self._sent_rows = None  # the device offsets below are not the host's
        full_qsl = common.query_start_loc.long()
        qsl = torch.zeros(n + 1, dtype=torch.long, device=full_qsl.device)
        torch.cumsum(device_lens.long(), 0, out=qsl[1:])
        tok = torch.arange(T, device=qsl.device)
        row = torch.searchsorted(qsl[1:], tok, right=True)
        src = full_qsl[row] + tok - qsl[row]
        tokens = self.token_rows.gpu
        tokens[:, :T] = tokens[:, src]
        full_lens = full_qsl[1:] - full_qsl[:-1]
        self.seq_lens.gpu[:n] -= (full_lens - device_lens.long()).to(torch.int32)
        self.query_start_loc.gpu[:n + 1] = qsl.to(torch.int32)
        # A new host tensor, not the pinned buffer: the copy of the scheduled offsets queued from that buffer may
        # not have run yet (under async scheduling the device is still busy with the step before), and writing
        # it now would hand the device the host's split instead.
        host_qsl = torch.zeros(n + 1, dtype=torch.int32)
        host_qsl[1:] = torch.from_numpy(np.cumsum(cpu_lens))
        # seq_lens_cpu keeps the scheduled lengths: an upper bound of the device values.
        return dataclasses.replace(common, num_actual_tokens=T, slot_mapping=self.slot_mapping.gpu[:T],
                                   query_start_loc_cpu=host_qsl)
