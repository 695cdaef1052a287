"""The model runner: turns a StepPlan into forward passes over the paged KV pool and returns next-token logits.

Every row reads and writes its sequence's K/V through its block table (model/cache.py's PagedKVCache): a prefill
chunk writes its columns into the sequence's blocks and attends over the blocks' first columns gathered in order;
decode rows go to the fused native step with their block tables, or through the modules with the same gather.

Batch invariance. CPU matmul and attention kernels pick their blocking from the shapes (a 1-row matmul is a
gemv, 2-3 rows and >= 4 rows take other paths; SDPA's numbers depend on the key length, and differ between a
batch of one and more), so a row's numbers would change with its batch-mates. The runner therefore makes every
shape a row sees a function of that row alone: decode rows are grouped by a key-length bucket that depends
only on the request's own length (a power of two), each group is cut into forwards of at most MAX_ROWS rows
(the native decode kernel's limit: beyond it torch's GEMM takes over, with other numbers) and padded to at least
MIN_ROWS rows (torch's GEMM with 1, 2-3 and >= 4 rows differs too), attention runs one row at a time
(`ForwardBatch.rowwise`: CPU SDPA splits a batch across threads, and a row's numbers depend on its thread), and a prefill chunk always runs one
request alone with chunk boundaries at fixed multiples of the chunk size. A request's greedy output is then the
same alone or among others.

LoRA: a row with an adapter (Sequence.lora) adds its adapter's low-rank products to each of the four block
matrices: in the native step (csrc/decode.cpp's add_lora, row by row) or, where the modules run, in its bucket's
group (model/lora/layers.py: a batched matmul computes each row alone). Either way its numbers do not depend on
the others' adapters.

The fast path keeps that property by construction: where the model takes the fused native decode step
(model/fused.py: a float32 model of the stock blocks on CPU), every decode row runs through it with its own block
table and its own length, no bucket and no padding. The native step computes each row's numbers from that row alone
(each product accumulates a row in the same order whatever the other rows; attention is per row), and whether it
is used depends on the model alone, so a request never changes path with its batch-mates.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from dataclasses import dataclass

from ..errors import GenerationConfigError
from ..model import ForwardBatch, PagedKVCache, Transformer
from ..model import fused
from ..model.kernels import MAX_ROWS
from ..model.recurrent import StateSlots, state_bytes
from .block_manager import BlockManager
from .encoder import EncoderCache
from .state_checkpoints import StateCheckpoints
from .scheduler import PrefillChunk, StepPlan
from .sequence import Sequence


MIN_ROWS = 4  # matmuls of >= 4 rows and attention over >= 2 give each row the same numbers, whatever the others
MIN_BUCKET = 128  # shortest key length a decode group attends over (short rows share one group)


class SlotView:
    """One slot of a slot cache (a draft model's: engine/speculation.py), shaped like a batch-of-one KVCache."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v  # (L, 1, Hkv, S, D) views into the shared cache

    def update(self, layer: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor):  # noqa: ANN201
        assert batch.write_start is not None, "a prefill chunk writes contiguous columns"
        end = batch.write_start + k.shape[2]
        self.k[layer, :, :, batch.write_start : end] = k
        self.v[layer, :, :, batch.write_start : end] = v
        return self.k[layer, :, :, : batch.kv_len], self.v[layer, :, :, : batch.kv_len]


class SeqView:
    """One sequence's blocks, shaped like a batch-of-one KVCache for a prefill chunk (the model only calls `update`):
    the chunk's columns are written into its blocks, and its first kv_len columns are gathered in order."""

    def __init__(self, pool: PagedKVCache, table: torch.Tensor, states: StateSlots | None = None,
                 slot: int | None = None) -> None:
        self.pool, self.table = pool, table  # (blocks,) int64
        self.states, self.rows = states, slice(slot, None if slot is None else slot + 1)  # its recurrent state slot

    def slots(self, layer: int, batch: ForwardBatch) -> list[torch.Tensor]:
        return self.states.read(layer, self.rows)  # (1, *shape) each

    def keep(self, layer: int, batch: ForwardBatch, state: list[torch.Tensor]) -> None:
        self.states.write(layer, self.rows, state)

    def update(self, layer: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor):  # noqa: ANN201
        assert batch.write_start is not None, "a prefill chunk writes contiguous columns"
        cols = torch.arange(batch.write_start, batch.write_start + k.shape[2], device=k.device)
        self.pool.write(layer, cols, self.table, k[0], v[0])
        return self.pool.gather(layer, self.table[None], batch.kv_len, k.dtype)  # (1, Hkv, kv_len, D) each


class RowsView:
    """Some sequences' blocks for one decode step (T = 1), read over the first `span` columns.

    Rows may repeat (padding up to MIN_ROWS); only the first `n_real` rows write into the pool.
    """

    def __init__(self, pool: PagedKVCache, tables: torch.Tensor, n_real: int, span: int,
                 states: StateSlots | None = None, slots: torch.Tensor | None = None) -> None:
        self.pool, self.tables, self.n_real, self.span = pool, tables, n_real, span  # tables: (B, W)
        self._batch = torch.arange(len(tables), device=tables.device)
        self.states, self.state_rows = states, slots  # (B,) each row's recurrent state slot (padding: repeats)

    def slots(self, layer: int, batch: ForwardBatch) -> list[torch.Tensor]:
        return self.states.read(layer, self.state_rows)  # (B, *shape) copies

    def keep(self, layer: int, batch: ForwardBatch, state: list[torch.Tensor]) -> None:
        n = self.n_real  # padding rows repeat a real row's slot: computed, never written
        self.states.write(layer, self.state_rows[:n], [t[:n] for t in state])

    def update(self, layer: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor):  # noqa: ANN201
        assert k.shape[2] == 1, "decode writes one column per row"
        col, n, bs = batch.write_index[:, 0], self.n_real, self.pool.block_size  # (B,)
        blocks = self.tables[self._batch, col // bs]  # (B,) the block each row's new column lives in
        new_k, new_v = k[:, :, 0], v[:, :, 0]  # (B, Hkv, D)
        self.pool.put(layer, blocks[:n], col[:n] % bs, new_k[:n], new_v[:n])
        out = []
        for span, new in zip(self.pool.gather(layer, self.tables, self.span, k.dtype), (new_k, new_v)):
            span[self._batch, :, col] = self.pool.stored(new)  # padding rows see their own new column too, as stored
            out.append(span)
        return out[0], out[1]


def _available_bytes() -> int | None:
    """Memory the system can still give (Linux's MemAvailable); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_cache_memory(model: Transformer, num_slots: int, max_len: int) -> None:
    """Before allocating the slot cache (every slot at full length, zero-filled): on CPU, refuse a cache larger
    than the memory available, naming the bytes and the flags that lower them, instead of dying in the allocation
    (or swapping the machine). (The paged KV pool replaces this with memory sized from what is free.)"""
    if model.device.type != "cpu":
        return
    cfg = model.config
    layers, heads, dim = cfg.kv_layout  # the layers that keep K/V, at their widest (Gemma 4)
    need = 2 * layers * num_slots * heads * max_len * dim \
        * torch.empty((), dtype=model.dtype).element_size()  # K and V
    free = _available_bytes()
    if free is not None and need > free:
        per_slot = need // num_slots
        raise GenerationConfigError(
            f"the KV cache needs {need / 2**30:.2f} GiB ({num_slots} slots x {max_len} tokens, {per_slot / 2**20:.1f} "
            f"MiB a slot) but {free / 2**30:.2f} GiB of memory is available: lower --max-num-seqs (max_num_seqs) to "
            f"at most {max(0, free // per_slot)} or --max-model-len (max_model_len), or use a smaller --dtype")


@dataclass(eq=False)
class DecodeRow:
    """One decode row that is not a Sequence's next step: a replayed token of a preempted sequence (its column
    num_tokens - 1 recomputed as its original decode step computed it), shaped as the runner reads a Sequence."""

    block_table: list[int]
    last_token: int  # the token fed at column num_tokens - 1
    num_tokens: int
    num_cached: int = 0
    lora: str | None = None  # the sequence's LoRA adapter: a replayed row computes what its decode step computed
    slot: int | None = None  # the sequence's place among the running: its recurrent state slot
    rope_delta: int = 0  # M-RoPE: what the sequence's positions add to their columns (Sequence.rope_delta)

    def hook_inputs(self) -> dict:
        return {}


def _tables(rows: list, width: int | None = None) -> torch.Tensor:
    """(B, W) int64 block tables of rows, padded with the null block (0)."""
    W = width or max(len(r.block_table) for r in rows)
    return torch.tensor([r.block_table[:W] + [0] * (W - min(W, len(r.block_table))) for r in rows],
                        dtype=torch.int64)


def _bucket(num_tokens: int, limit: int) -> int:
    """Key columns a decode row attends over: a power of two >= its length (fixed by the row alone)."""
    return min(limit, max(MIN_BUCKET, 1 << (num_tokens - 1).bit_length()))


def recurrent_layers(model: torch.nn.Module) -> dict[int, str]:
    """The layers that keep a recurrent state instead of K/V (issue 41's hybrids), by index: their kind."""
    cfg = model.config
    return {i: cfg.layer(i).mixer for i in range(cfg.num_hidden_layers) if not cfg.layer(i).keeps_kv}


def check_state_memory(model: torch.nn.Module, num_slots: int, checkpoints: int = 0) -> int:
    """The bytes of `num_slots` sequences' recurrent state (one slot per running sequence for each recurrent
    layer) and of the prefix cache's `checkpoints` copies of one sequence's state, checked against the memory
    available before anything is allocated."""
    per_slot = state_bytes(model.config, model.dtype)
    need = per_slot * (num_slots + checkpoints)
    free = _available_bytes() if model.device.type == "cpu" else None
    if free is not None and need > free:
        raise GenerationConfigError(
            f"the recurrent state needs {need / 2**30:.2f} GiB ({num_slots} sequences + {checkpoints} prefix-cache "
            f"checkpoints x {per_slot / 2**20:.1f} MiB) but {free / 2**30:.2f} GiB of memory is available: lower "
            f"--max-num-seqs (max_num_seqs) to at most {max(0, free // per_slot - checkpoints)} or state_checkpoints")
    return need


class ModelRunner:
    states: StateSlots | None = None  # the recurrent layers' state, a slot per running sequence (Sequence.slot)
    checkpoints: StateCheckpoints | None = None  # their states where cached prefixes end (the prefix cache's)

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, max_len: int,
                 cache_dtype: torch.dtype | None = None) -> None:
        mc = model.config
        self.model, self.max_len = model, max_len
        layers, heads, dim = mc.kv_layout  # the layers that keep K/V, at their widest (Gemma 4)
        self.cache = PagedKVCache(layers, num_blocks, heads, block_size, dim,
                                  cache_dtype or model.dtype, model.device)  # (L, N, Hkv, bs, D)
        self.window = mc.sliding_window
        self.blocks: BlockManager | None = None  # the engine's: prefill chunks hash their blocks into its cache
        # issue 43: the vision tower's features by image hash (the engine sets it for a model with a tower)
        self.encoder: EncoderCache | None = None

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> list[tuple[list[Sequence], torch.Tensor]]:
        """(requests, their (rows, V) float32 logits) for every request that chooses a token this step, in the
        groups they were computed in."""
        self._restore(plan)
        replayed = [DecodeRow(r.seq.block_table, r.seq.token_ids[c], c + 1, lora=r.seq.lora, slot=r.seq.slot,
                              rope_delta=r.seq.rope_delta)
                    for r in plan.replay for c in range(r.start, r.end)]
        if replayed and self.states is None:
            self._decode(replayed)  # the K/V of tokens already chosen: their logits are not needed again
        elif replayed:  # a recurrent state advances one token at a time: each sequence's columns in order
            for depth in range(max(r.end - r.start for r in plan.replay)):
                self._decode([DecodeRow(r.seq.block_table, r.seq.token_ids[r.start + depth], r.start + depth + 1,
                                        lora=r.seq.lora, slot=r.seq.slot, rope_delta=r.seq.rope_delta)
                              for r in plan.replay if r.start + depth < r.end])
        for r in plan.replay:  # either way the replayed columns are in the cache now
            r.seq.num_cached = r.end
        out = self._decode(plan.decode) if plan.decode else []
        for chunk in plan.prefill:
            logits = self._prefill(chunk)
            if chunk.samples:
                out.append(([chunk.seq], logits))
        return out

    def _restore(self, plan: StepPlan) -> None:
        """A hybrid's sequences admitted on a prefix-cache hit: their state slots take the state kept where the
        hit ends (before any forward of the step can drop that checkpoint)."""
        for seq in plan.admitted:
            if seq.restore_key is not None and seq.slot is not None and self.checkpoints is not None:
                self.checkpoints.restore(seq.restore_key, self.states, seq.slot)
            seq.restore_key = None

    def _decode(self, seqs: list[Sequence]) -> list[tuple[list[Sequence], torch.Tensor]]:
        groups: dict[int, list[Sequence]] = {}
        native: list[Sequence] = []
        out: list[tuple[list[Sequence], torch.Tensor]] = []
        plan = fused.rows_plan(self.model, self.cache, self.states)  # None: the modules for every row
        for seq in seqs:
            extra = seq.hook_inputs()
            if extra:  # a hook's extra model inputs belong to this row alone: it runs in a forward of its own
                out.append(([seq], self._decode_group([seq], _bucket(seq.num_tokens, self.max_len), extra, 1)))
            elif plan is not None:  # the native step adds an adapter row's products itself
                native.append(seq)
            else:
                groups.setdefault(_bucket(seq.num_tokens, self.max_len), []).append(seq)
        for first in range(0, len(native), MAX_ROWS):
            part = native[first : first + MAX_ROWS]
            out.append((part, self._decode_native(plan, part)))
        for span, group in sorted(groups.items()):  # shorter spans first: a verification's rows of one slot in order
            for first in range(0, len(group), MAX_ROWS):
                part = group[first : first + MAX_ROWS]
                out.append((part, self._decode_group(part, span)))
        return out

    @torch.inference_mode()
    def verify(self, rows: list) -> torch.Tensor:
        """(len(rows), V) float32 logits of decode rows given as objects with a Sequence's block_table, last_token,
        num_tokens (speculation.VerifyRow): several may share blocks, at consecutive columns in order, and each
        gets the numbers a single decode step of that row computes (native step, or its bucket and group).

        With recurrent layers a request's rows run one depth at a time (each row's state is the one its previous
        row left), and the state of its slot after each depth is kept: `rollback` then puts back the one after the
        last row whose token was accepted."""
        where = {id(row): i for i, row in enumerate(rows)}
        logits = torch.empty(len(rows), self.model.config.vocab_size)
        self._verified: dict[int, list[dict[int, list[torch.Tensor]]]] = {}
        depths = [rows] if self.states is None else _depths(rows)
        for level in depths:
            for part, part_logits in self._decode(level):
                logits[[where[id(row)] for row in part]] = part_logits
            if self.states is not None:
                for row in level:
                    self._verified.setdefault(row.slot, []).append(
                        {layer: [t[row.slot].clone() for t in ts] for layer, ts in self.states.tensors.items()})
        return logits

    def rollback(self, slot: int, depth: int) -> None:
        """After a verification: slot `slot`'s recurrent state becomes the one its request's row `depth` left (the
        last token it keeps in the cache); a no-op without recurrent layers."""
        kept = getattr(self, "_verified", {}).pop(slot, [])
        if self.states is not None and 0 <= depth < len(kept):
            for layer, values in kept[depth].items():
                self.states.write(layer, slice(slot, slot + 1), [v[None] for v in values])

    def _decode_native(self, plan: fused.RowsPlan, part: list[Sequence]) -> torch.Tensor:
        """(rows, V) logits of the fused native step: each row through its own block table, over its own columns."""
        ids = torch.tensor([[s.last_token] for s in part])  # (rows, 1)
        cols = torch.tensor([s.num_tokens - 1 for s in part])  # (rows,) column of the new token
        positions = _shifted(cols, part)  # = the column, but after M-RoPE's images
        slots = None if self.states is None else torch.tensor([s.slot for s in part])  # recurrent state slots
        logits = fused.decode_rows(plan, self.model, ids, positions, _tables(part), cols + 1, self._lora_slots(part),
                                   slots)
        assert logits is not None, "rows_plan said the native step takes this model and cache"
        for seq in part:
            seq.num_cached = seq.num_tokens
        return logits

    def _decode_group(self, group: list[Sequence], span: int, extra: dict | None = None,
                      min_rows: int = MIN_ROWS) -> torch.Tensor:
        device, n = self.model.device, len(group)
        pad = [group[0]] * (max(n, min_rows) - n)  # repeats of the first row: computed, never written
        tables = _tables(group + pad, -(-span // self.cache.block_size)).to(device)  # (B, blocks of span)
        ids = torch.tensor([[s.last_token] for s in group + pad], device=device)  # (B, 1)
        cols = torch.tensor([[s.num_tokens - 1] for s in group + pad], device=device)  # (B, 1)
        positions = _shifted(cols, group + pad)
        valid = torch.ones(len(tables), span, dtype=torch.bool, device=device)
        batch = dataclasses.replace(ForwardBatch.build(positions, cols, valid, span, self.window), rowwise=True,
                                    lora=self._lora_slots(group + pad))
        slots = None if self.states is None else torch.tensor([s.slot for s in group + pad], device=device)
        view = RowsView(self.cache, tables, n, span, self.states, slots)
        logits = self.model(ids, batch, view, **(extra or {})).float()
        for seq in group:
            seq.num_cached = seq.num_tokens
        return logits[:n]

    def _prefill(self, chunk: PrefillChunk) -> torch.Tensor:
        seq, start, end = chunk.seq, chunk.start, chunk.end
        device = self.model.device
        want_prompt = seq.params.wants_prompt_logprobs and start < len(seq.prompt_ids)
        ids = torch.tensor([seq.token_ids[start:end]], dtype=torch.long, device=device)  # (1, T)
        cols = torch.arange(start, end, device=device)[None]  # (1, T) positions = cache columns
        valid = torch.ones(1, end, dtype=torch.bool, device=device)
        batch = ForwardBatch.build(cols, cols, valid, end, self.window, write_start=start, last_only=not want_prompt)
        batch.lora = self._lora_slots([seq])
        if seq.mrope_positions is not None:  # M-RoPE: the images' 3-D positions, later tokens shifted
            batch.mrope_positions = _mrope_columns(seq, start, end).to(device)[:, None]  # (3, 1, T)
            batch.positions = batch.mrope_positions[0]
        if seq.images:
            batch = self._with_images(batch, seq, ids, start, end)
        if self.states is not None and start == 0:  # a sequence's first chunk (again, after a preemption)
            self.states.zero([seq.slot])
        view = SeqView(self.cache, torch.tensor(seq.block_table, dtype=torch.int64, device=device), self.states,
                       seq.slot)
        logits = self.model(ids, batch, view, **seq.hook_inputs()).float()  # (1, V), or (1, T, V) for prompt logprobs
        seq.num_cached = end
        if self.blocks is not None:
            key = self.blocks.cache_chunk(seq, start, end)
            if key is not None and self.checkpoints is not None:  # the state after this cacheable prefix
                self.checkpoints.save(key, self.states, seq.slot)
        if want_prompt:
            _record_prompt_logprobs(seq, start, end, logits[0])
            logits = logits[:, -1]
        return logits

    def _with_images(self, batch: ForwardBatch, seq: Sequence, ids: torch.Tensor, start: int,
                     end: int) -> ForwardBatch:
        """The chunk's images (the scheduler never splits one): their encoder rows replace their placeholders'
        embeddings (ForwardBatch.embeds), and where the tower says so (Gemma 3; Gemma 4: "sliding", on those layers
        only) each image's tokens attend each other both ways, as transformers' token_type_ids do in the prefill."""
        inside = [im for im in seq.images if start <= im.start and im.end <= end]
        if not inside:
            return batch
        tower = self.encoder.tower
        where = ids == tower.image_token_id  # (1, T)
        rows = torch.cat([self.encoder.features(im) for im in inside]).to(self.model.device)
        if int(where.sum()) != rows.shape[0]:
            raise ValueError(f"{int(where.sum())} image placeholders in prompt columns [{start}, {end}) but "
                             f"{rows.shape[0]} encoder rows for its images")
        batch.embeds = (where, rows)
        if not getattr(tower, "bidirectional", False):
            return batch
        starts = where & ~F.pad(where, (1, 0))[:, :-1]  # a run of placeholders is one image's block
        groups = torch.where(where, torch.cumsum(starts.long(), dim=1) - 1, -1)  # (1, T)
        return batch.with_blocks(groups, self.window, full=tower.bidirectional != "sliding")  # Gemma 4: sliding only

    def _lora_slots(self, rows: list) -> torch.Tensor | None:
        """(B,) int64 adapter slot of each row (-1: the base model), or None when no row has an adapter."""
        names = [_lora(row) for row in rows]
        if all(name is None for name in names):
            return None
        adapters = self.model.adapters
        return torch.tensor([-1 if name is None else adapters.slot(name) for name in names],
                            device=self.model.device)


def _shifted(cols: torch.Tensor, rows: list) -> torch.Tensor:
    """cols (rows, ...) shifted row by row by each row's M-RoPE offset (Sequence.rope_delta; a replayed or a
    verification row carries its request's): the rotary positions. A batch without images: cols themselves."""
    deltas = [getattr(row, "rope_delta", 0) for row in rows]
    if not any(deltas):
        return cols
    return cols + torch.tensor(deltas, device=cols.device).view(-1, *[1] * (cols.dim() - 1))


def _mrope_columns(seq: Sequence, start: int, end: int) -> torch.Tensor:
    """(3, end - start) M-RoPE positions of columns [start, end): the prompt's from its table, the generated
    tokens' (a preempted sequence prefilled again) their column + rope_delta on all three rows."""
    table = seq.mrope_positions  # (3, P)
    inside = table[:, start : min(end, table.shape[1])]
    first = max(start, table.shape[1])
    after = torch.arange(first, max(first, end)) + seq.rope_delta
    return torch.cat([inside, after.expand(3, -1)], dim=1)


def _depths(rows: list) -> list[list]:
    """Verification rows by depth: the i-th row of each slot (its request's column n - 1 + i) in level i."""
    seen: dict[int, int] = {}
    levels: list[list] = []
    for row in rows:
        depth = seen[row.slot] = seen.get(row.slot, -1) + 1
        if depth == len(levels):
            levels.append([])
        levels[depth].append(row)
    return levels


def _lora(row) -> str | None:  # noqa: ANN001 - a Sequence, or a verification row (no adapter)
    return getattr(row, "lora", None)


def _record_prompt_logprobs(seq: Sequence, start: int, end: int, logits: torch.Tensor) -> None:
    """Log-probability of each prompt token given those before it, from a chunk's (T, V) logits."""
    P, k = len(seq.prompt_ids), seq.params.top_logprobs
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None]  # the first token has no context
    logp = F.log_softmax(logits, dim=-1)  # (T, V)
    top = torch.topk(logp, k, dim=-1) if k else None
    # logits at column i predict token i + 1; a preempted request's recomputed chunks add none it has
    for i in range(max(start, len(seq.prompt_logprobs) - 1), min(end, P - 1)):
        row = i - start
        token = seq.prompt_ids[i + 1]
        alts = list(zip(top.indices[row].tolist(), top.values[row].tolist())) if top is not None else []
        seq.prompt_logprobs.append((float(logp[row, token]), alts))
