"""Ring flash attention as a Hugging Face ``transformers`` attention implementation (context parallelism).

Example (every rank runs the same code on its shard of each sequence)::

    from distcomm_attention.integrations import huggingface as ring_hf

    ring = ring_hf.register(layout="zigzag", group=(mesh, "cp"))      # after init_process_group
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ring.name)
    inputs = ring.shard_inputs(input_ids=ids, labels=labels)          # the FULL batch, same on every rank
    loss = model(**inputs).loss                                       # sum over the ring = the batch's loss
    loss.backward()                                                   # then sum parameter grads over the ring

Note [Hugging Face integration]
    Each rank runs the whole model on its shard of the sequence. Everything but attention is per token, so
    only attention needs the other ranks: transformers calls the function registered here with this
    rank's q/k/v (rotary embeddings already applied with the position ids the model was given), and it
    runs ``ring_flash_attn`` over the ring. What the model must be given, per rank (``shard_inputs``
    prepares all of it from the full batch):

        full batch (B, S)            this rank's model kwargs (S/W tokens each)
        input_ids               ->   input_ids       shard_sequence(input_ids)
        position_ids (or arange)->   position_ids    the GLOBAL positions of the shard (rotary angles)
        attention_mask          ->   attention_mask  the shard's key padding mask (bool)
        labels                  ->   labels, shift_labels   shifted by one on the FULL sequence, then
                                                     sharded (the model's own shift would cross shards)
                                     num_items_in_batch     the batch's number of targets: each rank's
                                                     loss is its summed token losses / that count
        packed documents        ->   cu_seq_lens_q/k the GLOBAL document boundaries (same on every rank)
                                     use_cache=False (no KV cache: keys are spread over the ring)

    - Masks: the mask function registered under the same name hands the attention function the 2-D
      padding mask as given (this rank's keys), never a 4-D one; causality, sliding windows and document
      boundaries are applied by the ring over global positions.
    - Packed documents: position ids restart at 0 for each document and ``cu_seq_lens_q`` (transformers'
      keyword; ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` on the full batch produces it)
      holds the boundaries of the WHOLE sequence. Without it, attention would cross documents: position ids
      alone cannot tell this rank where the other ranks' documents start.
    - Check mode (``DISTCOMM_CHECK=1`` or ``distcomm.check_mode()``): every call verifies, across the ring,
      that in each batch row and each document of ``cu_seq_lens_q`` the real (unpadded) tokens' position ids
      advance by one per global position of this layout, from any start. That is what the ring computes
      correctly: arange ids, left or right padding (with ids numbered from the first real token, as
      ``attention_mask.cumsum(-1) - 1`` gives them in generate and training), packed documents restarting
      at 0. It rejects what would be wrong, e.g. the model's own local ``arange`` on every rank, ids sharded
      with another layout, or a restart inside a document that ``cu_seq_lens_q`` does not mark (attention
      would cross it), with the same error on every rank of the ring.
    - Layout: ``register`` defaults to "zigzag", and ``shard_inputs`` and the attention function read the
      same registered layout (``ring.sharding``), so they agree by construction; the attention passes it to
      ``ring_flash_attn`` explicitly, never leaving it to the layout record of ``shard_sequence``.
    - Hybrid models (Qwen3-Next, Qwen3.5; Bamba, Granite 4.0, Nemotron-H): ``ring.attach(model)`` routes the
      model's gated-delta-rule or Mamba-2 layers (their short conv and recurrence) through
      :mod:`distcomm_attention.linear` on the same sharding, so one layout serves both kinds of layer
      (docs/hybrid.md).
    - Gradients: distcomm's convention (the total loss is the sum of the per-rank losses). Rank r's loss
      is its share of the batch's mean, so the parameters' gradient is the SUM of the ranks' gradients
      over the ring: ``all_reduce(p.grad)`` over the ring's group, or, under DDP/FSDP averaging over
      dp x cp ranks, multiply the loss by the ring size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

import distcomm
from distcomm.ring import RingComm
from distcomm_attention import BACKENDS, Sharding, context_parallel_attn, ring_flash_attn
from distcomm_attention.sharding import merge_sharding, shift_labels
from distcomm_attention.planning import balance, layouts
from distcomm_attention.planning.cost import check_hardware

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "distcomm_attention.integrations.huggingface needs transformers: pip install 'distcomm[hf]'"
    ) from e

__all__ = ["RingAttentionHF", "register"]

IGNORE_INDEX = -100  # transformers' label for "no target"
_HF_STRATEGIES = ("ring", "ulysses", "allgather", "auto")


def register(
    name: str = "ring_attention",
    *,
    layout: str | None = None,
    ring_size: int | None = None,
    group=None,
    backend: str = "auto",
    sharding: Sharding | None = None,
    strategy: str = "ring",
    balance_window: int | None = None,
    hardware=None,
) -> RingAttentionHF:
    """Register ring attention with transformers under ``name``; load models with ``attn_implementation=name``.

    Args:
        name: the attention implementation's name (``AttentionInterface`` and ``AttentionMaskInterface``).
            Registering the same name again replaces the options. It may not contain "flash": transformers
            takes any such name for a flash-attn kernel to load.
        layout: how sequences are sharded: "contiguous", "zigzag" (``None``: ``sharding``'s layout, else
            "zigzag", balanced causal work), "striped", or "balanced" / "auto" for packed documents (tokens
            placed by their documents, Note [Balanced layout]). ``shard_inputs`` shards with the same layout
            that the attention uses.
        ring_size: ranks per ring (``None``: the whole group); smaller rings are data parallel.
        group: the ring's group: a ProcessGroup, 1-D DeviceMesh or ``(mesh, "cp")`` (``None``: default group).
        backend: ``ring_flash_attn``'s backend.
        sharding: a :class:`~distcomm_attention.Sharding` giving layout, group and ring size at once;
            ``layout``, ``group`` or ``ring_size`` beside it must repeat its values.
        strategy: "ring" (``ring_flash_attn``), or "ulysses", "allgather" or "auto" (``context_parallel_attn``
            over the whole group; ``ring_size`` must be None).
        balance_window: layout "balanced" / "auto": the left window the work is balanced for (a model whose
            layers all use ``sliding_window`` w: w - 1); ``None``: no window (every layer attends the whole
            document). Layers with other windows still run exactly, only less evenly balanced.
        hardware: what ``strategy="auto"`` predicts with (``context_parallel_attn``'s ``hardware``: e.g.
            ``Hardware(p2p_gbps=50, a2a_gbps=50, allgather_gbps=50, reduce_scatter_gbps=50)`` for a group
            spanning nodes).

    Returns:
        The registered :class:`RingAttentionHF` (its ``name``, ``sharding`` and ``shard_inputs``).
    """
    layout, group, ring_size = merge_sharding(sharding, layout, group, ring_size)
    layout = "zigzag" if layout is None else layout
    name_of, window = layouts.split_spec(layout)  # a Sharding's balance window travels in its layout
    if window is not None:
        if balance_window is not None and balance_window != window:
            raise ValueError(f"`balance_window`={balance_window!r} conflicts with `sharding`'s balance_window={window}")
        layout, balance_window = name_of, window
    impl = RingAttentionHF(name, layout=layout, ring_size=ring_size, group=group, backend=backend, strategy=strategy,
                           balance_window=balance_window, hardware=hardware)
    AttentionInterface.register(name, impl)
    AttentionMaskInterface.register(name, impl.mask)
    return impl


@dataclass(frozen=True)
class RingAttentionHF:
    """A transformers attention function running ``ring_flash_attn``, and the input sharding it expects.

    See Note [Hugging Face integration] (module docstring). Create it with :func:`register`.
    """

    name: str
    layout: str = "zigzag"
    ring_size: int | None = None
    group: Any = None
    backend: str = "auto"
    strategy: str = "ring"
    balance_window: int | None = None
    hardware: Any = None  # a distcomm_attention.Hardware for strategy "auto"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or "flash" in self.name:
            raise ValueError(
                f"`name` must be a non-empty str without 'flash' (transformers loads a flash-attn kernel for "
                f"any attn_implementation containing 'flash'), got {self.name!r}"
            )
        layouts.check_layout(self.layout)
        self.sharding  # noqa: B018 - validates balance_window against the layout
        if self.backend not in BACKENDS:
            raise ValueError(f"Invalid backend {self.backend!r}. Must be one of: {', '.join(map(repr, BACKENDS))}")
        if self.strategy not in _HF_STRATEGIES:
            raise ValueError(
                f"Invalid strategy {self.strategy!r} for the Hugging Face integration. Must be one of: "
                f"{', '.join(map(repr, _HF_STRATEGIES))} (the hybrids take a 2-D mesh: use context_parallel_attn)"
            )
        if self.strategy != "ring" and self.ring_size is not None:
            raise ValueError(f"`strategy`={self.strategy!r} runs over the whole group: `ring_size`={self.ring_size} "
                             f"applies to strategy 'ring' only")
        check_hardware(self.hardware)

    @property
    def sharding(self) -> Sharding:
        """The sharding ``shard_inputs`` and the attention use (``.shard``, ``.gather``, ``.position_ids``)."""
        return Sharding(self.layout, group=self.group, ring_size=self.ring_size, balance_window=self.balance_window)

    # -- the attention function transformers calls ---------------------------------------------------

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """transformers' attention signature: q (B, H, S_local, D), k/v (B, H_kv, S_local, D) -> out
        (B, S_local, H, D), no attention weights. ``attention_mask``: this rank's 2-D key padding mask or None.
        Reads ``is_causal``, ``sliding_window``, ``softcap`` and ``cu_seq_lens_q/k`` from the keywords."""
        if dropout:
            raise ValueError(
                f"ring attention has no attention dropout, got dropout={dropout}: set the config's "
                "`attention_dropout` to 0.0"
            )
        if query.shape[2] != key.shape[2]:
            raise ValueError(
                f"ring attention needs as many keys as queries on each rank (self-attention without a KV "
                f"cache), got {query.shape[2]} queries and {key.shape[2]} keys: call the model with use_cache=False"
            )
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                f"ring attention takes a 2-D (batch, local_seq) padding mask, got a {attention_mask.dim()}-D "
                f"mask of shape {tuple(attention_mask.shape)}: pass the model the 2-D mask of this rank's tokens"
            )
        sinks = [name for name in ("s_aux", "sinks") if kwargs.get(name) is not None]
        if sinks:
            raise ValueError(
                f"ring attention has no attention sinks, got `{sinks[0]}` from {type(module).__name__} (GPT-OSS-style "
                "sinks): models with sinks are not supported")
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)
        window = _window(kwargs.get("sliding_window"), causal)
        cu_seqlens = _boundaries(kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))
        if distcomm.is_check_mode():
            self._verify_positions(kwargs.get("position_ids"), cu_seqlens, query, attention_mask)
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        options = dict(causal=bool(causal), softmax_scale=scaling, layout=self.sharding.spec, group=self.group,
                       backend=self.backend, attention_mask=attention_mask, window_size=window,
                       softcap=float(kwargs.get("softcap") or 0.0), cu_seqlens=cu_seqlens)
        if self.strategy == "ring":
            return ring_flash_attn(q, k, v, ring_size=self.ring_size, **options), None
        return context_parallel_attn(q, k, v, strategy=self.strategy, hardware=self.hardware, **options), None

    def mask(self, batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
             attention_mask=None, **kwargs) -> torch.Tensor | None:
        """transformers' mask hook (AttentionMaskInterface): the 2-D padding mask as given, or None.

        The causal, sliding-window and packed-document patterns transformers would build here are over
        LOCAL indices; the ring applies them over global positions instead. A pattern it does not reproduce
        (chunked attention, Llama4's ``attention_chunk_size``; block-wise or OR-ed overlays such as image tokens
        attending both ways) is refused rather than dropped.
        """
        unsupported = sorted({what for name in _mask_parts(mask_function)
                              for part, what in _UNSUPPORTED_MASKS.items() if part in name})
        if unsupported:
            raise ValueError(f"ring attention does not reproduce this model's attention mask: "
                             f"{', '.join(unsupported)} (it applies causal, sliding-window, packed-document and "
                             "padding masks only)")
        return attention_mask

    # -- linear-attention layers of hybrid models ------------------------------------------------------

    def attach(self, model: torch.nn.Module, *, kernel: str = "auto") -> torch.nn.Module:
        """Run ``model``'s linear-attention layers under context parallelism on this sharding; returns ``model``.

        Each GatedDeltaNet module (Qwen3-Next, Qwen3.5) and each Mamba-2 mixer of Bamba, Granite 4.0
        (GraniteMoeHybrid) and Nemotron-H gets a forward that calls its own projections, norm and output
        projection, and the sharded conv and recurrence of :mod:`distcomm_attention.linear`
        (``kernel``: "auto", "torch" or "fla"); the softmax layers already use this implementation when the
        model was made with ``attn_implementation=ring.name``. The layout must be one for the whole group
        (``ring_size`` None). Train with ``use_cache=False`` (``shard_inputs`` sets it).

        Raises:
            ValueError: the model's attention implementation is not this one, or it has no linear-attention
                layer. NotImplementedError: a GatedDeltaNet module of another shape, or another mixer
                (Falcon-H1's, Zamba2's, Mamba-1's), before any layer is changed.
        """
        from distcomm_attention.linear import layers

        used = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if used is not None and used != self.name:
            raise ValueError(
                f"the model's attention implementation is {used!r}, not {self.name!r}: make it with "
                f"attn_implementation={self.name!r} so that its softmax layers use the same sharding"
            )
        found = []  # every layer checked before any forward is replaced: a refusal leaves the model as it was
        for module in model.modules():
            name = type(module).__name__
            if name in layers.MAMBA2_MIXERS:
                found.append((module, layers.mamba2_forward))
            elif "GatedDeltaNet" in name and layers.is_gdn_layer(module):
                found.append((module, layers.gdn_forward))
            elif "GatedDeltaNet" in name or name.endswith(("Mixer", "MambaLayer")):
                raise NotImplementedError(f"{name} is not a layer attach() knows: {layers.SUPPORTED}")
        if not found:
            raise ValueError(f"{type(model).__name__} has no linear-attention layer to attach ({layers.SUPPORTED})")
        for module, layer_forward in found:
            module.forward = functools.partial(_linear_forward, layer_forward, self, module, kernel)
        object.__setattr__(self, "_linear_layers", True)  # (shard_inputs refuses padded one-token shards for them)
        return model

    # -- inputs ---------------------------------------------------------------------------------------

    def shard_inputs(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """This rank's model keywords from the FULL batch (identical on every rank of the ring).

        Args:
            input_ids: (batch, seq) token ids, or ``inputs_embeds`` (batch, seq, hidden).
            labels: (batch, seq) causal-LM labels as transformers takes them (unshifted; -100 = no target).
            position_ids: (batch or 1, seq), restarting at 0 for each packed document; ``None``: 0..seq-1.
                Packed rows must share their boundaries (``cu_seqlens`` applies to every row).
            attention_mask: (batch, seq) padding mask, 1/True = a real token.

        Returns:
            Keywords for ``model(**inputs)``: ``input_ids``/``inputs_embeds``, ``position_ids`` (global
            positions of this rank's tokens), ``attention_mask`` (bool; left out when nothing is padded, so
            the ring runs its unmasked kernels), ``labels`` and
            ``shift_labels`` (shifted on the full sequence, the last token of each document without a
            target) with ``num_items_in_batch`` (the batch's target count), ``cu_seq_lens_q/k`` (packed
            documents only) and ``use_cache=False``.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of `input_ids` and `inputs_embeds` (the full batch)")
        tokens = input_ids if input_ids is not None else inputs_embeds
        if tokens.dim() < 2:
            raise ValueError(f"`input_ids`/`inputs_embeds` must be (batch, seq, ...), got shape {tuple(tokens.shape)}")
        batch, seq = tokens.shape[:2]
        given = position_ids
        if position_ids is None:
            position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0)
        _check_2d("position_ids", position_ids, seq, batch, broadcast=True)
        if attention_mask is not None:
            _check_2d("attention_mask", attention_mask, seq, batch)
        # GPU tensors: one wait for the GPU, here (none without position ids and mask: 0..seq-1 never restarts)
        positions, real = _on_host(torch.arange(seq).unsqueeze(0) if given is None else given, attention_mask)
        cu_seqlens = _packed_boundaries(positions, real)

        sharding = self.sharding

        docs = None if cu_seqlens is None else cu_seqlens.tolist()

        def shard(t: torch.Tensor) -> torch.Tensor:  # contiguous: transformers views labels with .view(-1)
            return sharding.shard(t, cu_seqlens=docs).contiguous()

        inputs: dict[str, Any] = {"input_ids" if input_ids is not None else "inputs_embeds": shard(tokens)}
        inputs["position_ids"] = shard(position_ids)
        if real is not None and not bool(real.all()):  # decided on the full batch: the same on every rank
            inputs["attention_mask"] = shard(attention_mask.bool())
            if getattr(self, "_linear_layers", False) and inputs["attention_mask"].shape[1] == 1:
                raise ValueError(
                    f"padded inputs of {seq} tokens on {seq // inputs['attention_mask'].shape[1]} ranks leave one "
                    "token per rank, and transformers gives linear-attention layers no padding mask for a "
                    "one-token input (it takes it for a decode step), so a padded token would enter their state: "
                    "use at least two tokens per rank, or no padding (every rank raises this error)"
                )
        if labels is not None:
            _check_2d("labels", labels, seq, batch)
            # a document's last token has no next token in its document
            shifted = shift_labels(labels, cu_seqlens=docs, ignore_index=IGNORE_INDEX)
            local = shard(shifted)
            inputs.update(labels=local, shift_labels=local, num_items_in_batch=(shifted != IGNORE_INDEX).sum())
        if cu_seqlens is not None:  # on the host: every layer plans from them without waiting for the GPU
            host = torch.tensor(docs, dtype=cu_seqlens.dtype)
            inputs.update(cu_seq_lens_q=host, cu_seq_lens_k=host)
        inputs["use_cache"] = False
        return inputs

    def _verify_positions(self, given: torch.Tensor | None, cu_seqlens, query: torch.Tensor,
                          attention_mask: torch.Tensor | None) -> None:
        """Check mode: in each batch row and document, the real tokens' position ids are their global positions
        under this layout plus one constant (Note [Hugging Face integration]). Decided on the ring's gathered
        facts, so every rank of the ring raises the same error (the ring would otherwise hang)."""
        if given is None:
            return
        comm = RingComm(self.group, self.ring_size)
        batch, local = query.shape[0], query.shape[2]
        bounds = None if cu_seqlens is None else [int(x) for x in torch.as_tensor(cu_seqlens).flatten().tolist()]
        docs = 1 if bounds is None else max(len(bounds) - 1, 1)
        ids = given.reshape(1, -1) if given.dim() == 1 else given
        rows, cols = (ids.shape[0], ids.shape[1]) if ids.dim() == 2 else (-1, -1)
        try:
            layouts.check_global_length(self.layout, local * comm.size, comm.size)
            splits = 1
        except ValueError:  # ring_flash_attn reports it
            splits = 0
        heads = comm.all_gather_ints([local, batch, docs, splits, rows, cols], query.device)
        wrong = [(p, h) for p, h in enumerate(heads) if h[5] != h[0] or h[4] not in (1, h[1])]
        if wrong:
            shapes = "; ".join(f"ring position {p}: {'more than 2 dims' if h[4] < 0 else (h[4], h[5])} for "
                               f"{h[1]} rows of {h[0]} tokens" for p, h in wrong)
            raise ValueError(
                f"position_ids given to the model must be (batch or 1, local_seq) on every rank of the ring, got "
                f"{shapes}: build the inputs with `shard_inputs`"
            )
        if any(h[:4] != heads[0][:4] for h in heads) or not heads[0][3]:
            return  # shapes, documents or a length the layout cannot split: ring_flash_attn says so on every rank
        real = attention_mask.bool() if isinstance(attention_mask, torch.Tensor) \
            and tuple(attention_mask.shape) == (batch, local) else torch.ones(batch, local, dtype=torch.bool)
        concrete = balance.resolve(self.sharding.spec, local * comm.size, comm.size,
                                   None if bounds is None else tuple(bounds))
        pos = layouts.positions(concrete, local * comm.size, comm.size, comm.rank).to(ids.device)
        offset = ids.long().expand(batch, local) - pos
        doc = torch.zeros_like(pos) if bounds is None else \
            (torch.searchsorted(torch.tensor(bounds, device=pos.device), pos, right=True) - 1).clamp(0, docs - 1)
        cell = (torch.arange(batch, device=pos.device)[:, None] * docs + doc).expand(batch, local)
        real = real.to(ids.device)
        big = 2**62
        lo = torch.full((batch * docs,), big, dtype=torch.long, device=ids.device)
        hi = torch.full((batch * docs,), -big, dtype=torch.long, device=ids.device)
        lo = lo.scatter_reduce(0, cell[real], offset[real], "amin")
        hi = hi.scatter_reduce(0, cell[real], offset[real], "amax")
        gathered = torch.tensor(comm.all_gather_ints(lo.tolist() + hi.tolist(), query.device))
        lows, highs = gathered[:, : batch * docs], gathered[:, batch * docs :]
        low, high = lows.min(0).values, highs.max(0).values
        bad = ((low < high) & (low != big)).nonzero().flatten()  # cells with real tokens and two offsets
        if not bad.numel():
            return
        j = int(bad[0])
        where = f"row {j // docs}" + (f", document {j % docs} of cu_seq_lens_q" if bounds is not None else "")
        per_rank = ", ".join(
            f"{int(lows[p, j])}" + ("" if lows[p, j] == highs[p, j] else f" to {int(highs[p, j])}")
            + f" on ring position {p}" for p in range(len(heads)) if lows[p, j] != big
        )
        raise ValueError(
            f"position_ids given to the model are not the global positions of the ranks' tokens under "
            f"layout={self.layout!r} ({where}: position id minus global position is {per_rank}; in each row"
            f"{' and document' if bounds is not None else ''} it must be one constant over the real tokens, i.e. "
            "ids advancing by one per global position from any start, as after left or right padding): build "
            "the inputs with `shard_inputs`, or pass `position_ids=ring.sharding.position_ids(local_seq)` "
            "(and, for packed documents, the global `cu_seq_lens_q`)"
        )


def _linear_forward(layer_forward, impl: RingAttentionHF, module, kernel: str, hidden_states: torch.Tensor,
                    cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
    """A linear-attention layer's forward under context parallelism (``RingAttentionHF.attach``)."""
    if cache is not None or kwargs.get("cache_params") is not None:
        raise ValueError("context-parallel linear attention keeps no cache: call the model with use_cache=False")
    cu_seqlens = _boundaries(kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))
    return layer_forward(module, hidden_states, sharding=impl.sharding, cu_seqlens=cu_seqlens,
                         attention_mask=attention_mask, kernel=kernel)


def _window(sliding_window, causal: bool) -> tuple[int, int]:
    """transformers' ``sliding_window`` (key j visible to query i iff i - j < w, causal; |i - j| <= w,
    bidirectional) as ring_flash_attn's (left, right)."""
    if sliding_window is None:
        return (-1, -1)
    return (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)


def _boundaries(cu_q, cu_k):
    if cu_k is not None and cu_k is not cu_q and (cu_q is None or not torch.equal(torch.as_tensor(cu_q), torch.as_tensor(cu_k))):
        raise ValueError(
            "ring attention is self-attention: `cu_seq_lens_k` must equal `cu_seq_lens_q` (the global document "
            f"boundaries), got {cu_q!r} and {cu_k!r}"
        )
    return cu_q


def _check_2d(name: str, t, seq: int, batch: int, broadcast: bool = False) -> None:
    """``t`` a (batch, seq) tensor; with ``broadcast`` (position ids) also (1, seq), shared by every row."""
    rows = (1, batch) if broadcast else (batch,)
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != seq or t.shape[0] not in rows:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        allowed = f"({batch} or 1, {seq})" if broadcast and batch != 1 else f"({batch}, {seq})"
        raise ValueError(f"`{name}` must be a {allowed} tensor over the full sequence, got {shape}")


def _on_host(position_ids: torch.Tensor, attention_mask) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Host copies of ``position_ids`` and of the padding mask (bool; None without a mask tensor): GPU tensors
    are read back in one copy, one wait for the GPU where each question asked of them would be one."""
    if not isinstance(attention_mask, torch.Tensor):
        return position_ids.cpu(), None
    if position_ids.device != attention_mask.device:
        return position_ids.cpu(), attention_mask.cpu().bool()
    rows = position_ids.shape[0]
    both = torch.cat([position_ids, attention_mask.ne(0).to(position_ids.dtype)]).cpu()
    return both[:rows], both[rows:].bool()


_UNSUPPORTED_MASKS = {  # a part of transformers' mask function (masking_utils) -> what it is
    "chunked_overlay": "chunked attention (attention_chunk_size)",
    "blockwise_overlay": "block-wise attention",
    "or_masks": "an OR-ed mask overlay (tokens that see more than the causal pattern)",
}


def _mask_parts(fn, depth: int = 0) -> list[str]:
    """The qualified names of a mask function and of the functions its closures hold (and_masks / or_masks
    combine others), to a small depth."""
    if fn is None or depth > 6:
        return []
    names = [getattr(fn, "__qualname__", type(fn).__name__)]
    for cell in getattr(fn, "__closure__", None) or ():
        held = cell.cell_contents
        for f in held if isinstance(held, (tuple, list)) else (held,):
            if callable(f):
                names += _mask_parts(f, depth + 1)
    return names


def _packed_boundaries(position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Global document boundaries where position ids restart at 0 on a real token after a real token, with or
    without padding between them (None: one document per row). A restart with no real token before it in the
    row is where a left-padded row's text begins (transformers numbers it from 0 at its first real token), not
    a new document."""
    if position_ids.shape[1] < 2:
        return None
    restart = position_ids[:, 1:] == 0
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] == position_ids.shape[1]:
        real = attention_mask.bool()
        restart = restart & (real.cumsum(1)[:, :-1] > 0) & real[:, 1:]
    if not bool(restart.any()):
        return None
    if restart.shape[0] > 1 and not bool((restart == restart[:1]).all()):
        raise ValueError(
            "packed documents must have the same boundaries in every batch row (cu_seqlens applies to every "
            "row): pack each batch row's documents at the same positions, or use one row (batch 1)"
        )
    starts = restart[0].nonzero().flatten() + 1
    seq = position_ids.shape[1]
    bounds = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), seq)])
    return bounds.to(torch.int32)
