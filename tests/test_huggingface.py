"""The Hugging Face transformers integration (skipped without transformers), cheapest first.

1. in-process: argument errors, ``register`` with a ``Sharding``, ``shard_inputs`` on one process (label
   shift, packed boundaries, target count), the attention function's refusals, what check mode accepts
   (padding, cumsum ids, packed documents) and rejects (restarts without boundaries, jumps, bad shapes), and
   the ring model on one process == the model with transformers' own ``sdpa`` attention (float64 on CPU:
   exact; ``eager`` runs its softmax in float32);
2. gloo world of 2 ranks: a tiny randomly initialised Llama (no downloads) with ``attn_implementation`` set
   to the ring, each rank given its shard of the batch, against the same weights run on the whole batch in
   one process with ``sdpa``: logits at each rank's positions, the per-rank losses adding up to the batch's
   loss, and parameter gradients summed over ranks equal to the single-process ones; contiguous, zigzag and
   striped layouts, a padding mask (left and right padding, arange or attention-mask cumsum position ids),
   packed documents (position ids restarting per document vs transformers' own packed-sequence mask), a
   Mistral sliding window, all with and without check mode; check mode catching local position ids and
   packed documents without boundaries on every rank;
4. GPU (marked ``gpu2``): the same padded batch in bf16/fp16 on 2 GPUs (NCCL, Triton kernels), with the
   flash-attn criterion against the fp32 model: errors at most 2x those of sdpa in the same dtype.
"""

import os
import re

import pytest
import torch
import torch.nn.functional as torch_F

from tests.optional import require

require("transformers")

import distcomm  # noqa: E402
from distcomm_attention.planning import balance, layouts  # noqa: E402
from distcomm_attention.integrations import huggingface as ring_hf  # noqa: E402
from tests.dist_harness import run_world  # noqa: E402

FP64 = dict(rtol=1e-10, atol=1e-12)
VOCAB, SEQ = 128, 16

for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")  # no NVLink multicast (GPU runs)


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        intermediate_size=96, max_position_embeddings=256, attention_dropout=0.0,
    )


def _model(attn_implementation: str):
    """The same randomly initialised weights for every implementation (seeded), float64."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(_config(), attn_implementation=attn_implementation, dtype=torch.float64)


def _ids(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _summed_loss(logits: torch.Tensor, targets: torch.Tensor, count) -> torch.Tensor:
    """Float64 cross-entropy summed over targets (-100 skipped), over ``count`` (the batch's target count)."""
    return torch_F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum") / count


# ------------------------------------------------------------------------------------------------------
# 1. in-process
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="ring_flash_attn"), r"`name` must be a non-empty str without 'flash' .*got 'ring_flash_attn'"),
        (dict(layout="spiral"), r"Invalid layout 'spiral'. Must be one of: 'contiguous', 'zigzag', 'striped'"),
        (dict(backend="cuda"), r"Invalid backend 'cuda'. Must be one of: 'auto'"),
    ],
)
def test_register_argument_errors(kwargs, match):
    """Bad options are refused at registration, naming the value and what is allowed."""
    with pytest.raises(ValueError, match=match):
        ring_hf.register(**kwargs)


def test_register_with_a_sharding():
    """``register`` takes a ``Sharding`` (the layout ``shard_inputs`` and the attention both use); the default
    stays zigzag; a layout beside a sharding that says otherwise is refused, naming both."""
    import distcomm_attention as da

    assert ring_hf.register("ring_attention_test_default").sharding == da.Sharding("zigzag")
    ring = ring_hf.register("ring_attention_test_sharding", sharding=da.Sharding("striped"))
    assert ring.layout == "striped" and ring.sharding == da.Sharding("striped")
    with pytest.raises(ValueError, match=r"`layout`='zigzag' conflicts with `sharding`=Sharding\(layout='striped'"):
        ring_hf.register("ring_attention_test_conflict", layout="zigzag", sharding=da.Sharding("striped"))


def _check_positions(ring, position_ids, mask=None, cu_seqlens=None, n=SEQ):
    """Run the attention function in check mode on one process with these position ids; the error or None."""
    q = torch.randn(2, 4, n, 16, dtype=torch.float64)
    kv = torch.randn(2, 2, n, 16, dtype=torch.float64)
    try:
        with distcomm.check_mode():
            ring(torch.nn.Module(), q, kv, kv, mask, position_ids=position_ids, cu_seq_lens_q=cu_seqlens)
    except ValueError as e:
        return str(e)
    return None


def test_check_mode_accepts_what_the_ring_computes_correctly():
    """Check mode accepts every numbering the unchecked ring computes correctly (left and right padding with
    arange or attention-mask cumsum ids, a start other than 0, packed documents restarting at 0 with their
    boundaries) and rejects ids that restart inside a document or jump, and ids of the wrong shape."""
    ring = ring_hf.register("ring_attention_test_check_positions", layout="zigzag")
    mask = torch.ones(2, SEQ, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[1, -5:] = False  # right padding
    cumsum = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)  # transformers' generate / training convention
    arange = torch.arange(SEQ)[None]
    packed = _packed_position_ids()
    for ids, m, cu in [(arange, None, None), (arange.expand(2, SEQ), mask, None), (cumsum, mask, None),
                       (arange + 7, None, None), (packed, None, torch.tensor([0, 5, 12, 16]))]:
        assert _check_positions(ring, ids, m, cu) is None, (ids, m, cu)
    restart = "position id minus global position is -12 to 0 on ring position 0; in each row it must be one constant"
    assert restart in (_check_positions(ring, packed) or "")  # boundaries not given: attention would cross them
    jump = arange.clone()
    jump[0, 8:] += 1
    assert re.match(r"position_ids given to the model are not the global positions of the ranks' tokens under "
                    r"layout='zigzag' \(row 0: position id minus global position is 0 to 1 on ring position 0",
                    _check_positions(ring, jump) or "")
    wrong_shape = "must be (batch or 1, local_seq) on every rank of the ring, got ring position 0: (2, 8) for 2 rows of 16"
    assert wrong_shape in (_check_positions(ring, arange.expand(2, SEQ)[:, :8]) or "")


def test_shard_inputs_on_one_process():
    """On one process the shard is the batch: labels shifted by one (last target dropped), the target count
    of the batch, position ids 0..S-1, a bool mask (none when nothing is padded), no KV cache, no boundaries
    for unpacked rows."""
    ring = ring_hf.register("ring_attention_test_one", layout="zigzag")
    ids = _ids()
    labels = ids.clone()
    labels[1, :4] = -100
    mask = torch.ones(2, SEQ, dtype=torch.long)
    assert "attention_mask" not in ring.shard_inputs(input_ids=ids, attention_mask=mask)
    mask[1, -2:] = 0
    got = ring.shard_inputs(input_ids=ids, labels=labels, attention_mask=mask)
    assert torch.equal(got["input_ids"], ids)
    assert torch.equal(got["position_ids"], torch.arange(SEQ)[None])
    assert torch.equal(got["attention_mask"], mask.bool())
    assert torch.equal(got["shift_labels"][:, :-1], labels[:, 1:]) and bool((got["shift_labels"][:, -1] == -100).all())
    assert got["labels"] is got["shift_labels"]
    assert int(got["num_items_in_batch"]) == 2 * (SEQ - 1) - 3
    assert got["use_cache"] is False and "cu_seq_lens_q" not in got


@pytest.mark.gpu
def test_shard_inputs_gives_the_boundaries_on_the_host():
    """Inputs on a GPU: cu_seq_lens_q/k come back on the host, so that no attention layer waits for the GPU to
    read them (a CUDA tensor is read back on every call)."""
    ring = ring_hf.register("ring_attention_test_host_bounds", layout="contiguous")
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8]], device="cuda")
    got = ring.shard_inputs(input_ids=_ids(1).cuda(), labels=_ids(1).cuda(), position_ids=pos)
    assert got["input_ids"].is_cuda and got["cu_seq_lens_q"].device.type == "cpu"
    assert got["cu_seq_lens_q"].tolist() == [0, 3, 7, 16] and got["cu_seq_lens_k"] is got["cu_seq_lens_q"]
    assert got["shift_labels"].is_cuda and got["shift_labels"][0, [2, 6, 15]].tolist() == [-100, -100, -100]


@pytest.mark.gpu
def test_shard_inputs_reads_the_batch_back_once():
    """GPU position ids and padding mask are read back in one copy: one synchronizing call under
    ``set_sync_debug_mode("warn")`` (each question asked of them on the GPU was one: any restart, every row
    alike, where, the boundaries' list, any padding, and the labels' fill). Given on the host, nothing waits:
    queued behind a GPU sleep the call returns while the sleep runs. The results are the host call's."""
    import warnings

    ring = ring_hf.register("ring_attention_test_read_once", layout="contiguous")
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8]] * 2)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, -2:] = 0
    ids, labels = _ids(2), _ids(2)
    want = ring.shard_inputs(input_ids=ids, labels=labels, position_ids=pos, attention_mask=mask)
    ids_gpu, labels_gpu = ids.cuda(), labels.cuda()

    def synchronizing_calls(**kw):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")  # (switched on before collecting: the first switch reports itself)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                got = ring.shard_inputs(input_ids=ids_gpu, labels=labels_gpu, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return got, [w for w in seen if "synchroniz" in str(w.message)]

    got, synced = synchronizing_calls(position_ids=pos.cuda(), attention_mask=mask.cuda())
    assert len(synced) == 1, [str(w.message) for w in synced]
    for key in ("input_ids", "position_ids", "attention_mask", "labels", "shift_labels"):
        assert torch.equal(got[key].cpu(), want[key]), key
    assert got["cu_seq_lens_q"].tolist() == want["cu_seq_lens_q"].tolist() == [0, 3, 7, 16]
    assert int(got["num_items_in_batch"]) == int(want["num_items_in_batch"])

    got, synced = synchronizing_calls(position_ids=pos, attention_mask=mask)
    assert not synced, [str(w.message) for w in synced]
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))
    slept = torch.cuda.Event()
    slept.record()
    got = ring.shard_inputs(input_ids=ids_gpu, labels=labels_gpu, position_ids=pos, attention_mask=mask)
    assert not slept.query(), "shard_inputs with host position ids and mask waited for the GPU"
    torch.cuda.synchronize()
    assert torch.equal(got["shift_labels"].cpu(), want["shift_labels"])


def test_shard_inputs_packed_documents():
    """Position ids restarting at 0 give the global boundaries, and no token is trained to predict the next
    document's first token."""
    ring = ring_hf.register("ring_attention_test_packed", layout="contiguous")
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
    got = ring.shard_inputs(input_ids=_ids(1), labels=_ids(1), position_ids=pos)
    assert got["cu_seq_lens_q"].tolist() == [0, 3, 7, 16] and got["cu_seq_lens_k"] is got["cu_seq_lens_q"]
    assert got["shift_labels"][0, [2, 6, 15]].tolist() == [-100, -100, -100]
    assert int(got["num_items_in_batch"]) == SEQ - 3
    with pytest.raises(ValueError, match=r"packed documents must have the same boundaries in every batch row"):
        ring.shard_inputs(input_ids=_ids(2), position_ids=torch.cat([pos, torch.arange(SEQ)[None]]))
    with pytest.raises(ValueError, match=r"`labels` must be a \(2, 16\) tensor over the full sequence, got \(2, 8\)"):
        ring.shard_inputs(input_ids=_ids(2), labels=_ids(2)[:, :8])
    # labels and padding masks are per row (position ids alone may be shared by every row)
    with pytest.raises(ValueError, match=r"`labels` must be a \(2, 16\) tensor over the full sequence, got \(1, 16\)"):
        ring.shard_inputs(input_ids=_ids(2), labels=_ids(1))
    with pytest.raises(ValueError, match=r"`attention_mask` must be a \(2, 16\) tensor .*got \(1, 16\)"):
        ring.shard_inputs(input_ids=_ids(2), attention_mask=torch.ones(1, SEQ, dtype=torch.long))
    assert ring.shard_inputs(input_ids=_ids(2), position_ids=torch.arange(SEQ)[None])["position_ids"].shape[0] == 1
    with pytest.raises(ValueError, match=r"pass exactly one of `input_ids` and `inputs_embeds`"):
        ring.shard_inputs()


def test_attention_function_refusals():
    """What the ring cannot do is refused with the fix named: dropout, a KV cache, a 4-D mask."""
    ring = ring_hf.register("ring_attention_test_refusals")
    module = torch.nn.Module()
    q = torch.randn(1, 4, 8, 16, dtype=torch.float64)
    kv = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"ring attention has no attention dropout, got dropout=0.1"):
        ring(module, q, kv, kv, None, dropout=0.1)
    with pytest.raises(ValueError, match=r"got 8 queries and 12 keys: call the model with use_cache=False"):
        ring(module, q, torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16), None)
    with pytest.raises(ValueError, match=r"takes a 2-D \(batch, local_seq\) padding mask, got a 4-D mask"):
        ring(module, q, kv, kv, torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"`cu_seq_lens_k` must equal `cu_seq_lens_q`"):
        ring(module, q, kv, kv, None, cu_seq_lens_q=torch.tensor([0, 8]), cu_seq_lens_k=torch.tensor([0, 4, 8]))
    with pytest.raises(ValueError, match=r"ring attention has no attention sinks, got `s_aux`"):
        ring(module, q, kv, kv, None, s_aux=torch.zeros(4))  # GPT-OSS passes its sinks so
    ring(module, q, kv, kv, None, s_aux=None)  # a model without sinks may pass None
    out, weights = ring(module, q, kv, kv, None)
    assert out.shape == (1, 8, 4, 16) and weights is None


def test_one_process_equals_sdpa():
    """Without a process group the ring model is the model: logits equal transformers' sdpa in float64."""
    ring = ring_hf.register("ring_attention_test_sdpa", layout="zigzag")
    ids = _ids()
    got = _model(ring.name)(**ring.shard_inputs(input_ids=ids)).logits
    want = _model("sdpa")(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, **FP64)


def _mistral(attn_implementation: str, sliding_window: int | None = 5):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        intermediate_size=96, max_position_embeddings=256, sliding_window=sliding_window,
    )
    torch.manual_seed(0)
    return MistralForCausalLM._from_config(config, attn_implementation=attn_implementation, dtype=torch.float64)


def test_gemma2_softcap_and_window_pass_through():
    """Gemma 2's logit soft-capping and sliding window reach the ring: logits equal transformers' eager
    attention (float32 softmax, hence 1e-6), and differ from the same model without soft-capping."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    ring = ring_hf.register("ring_attention_test_gemma2", layout="zigzag")

    def gemma2(impl, softcap):
        config = Gemma2Config(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=VOCAB, intermediate_size=96, max_position_embeddings=256, sliding_window=5,
            attn_logit_softcapping=softcap, initializer_range=0.5,  # scores large enough to be capped
        )
        torch.manual_seed(0)
        return Gemma2ForCausalLM._from_config(config, attn_implementation=impl, dtype=torch.float64)

    ids = _ids()
    got = gemma2(ring.name, 2.0)(**ring.shard_inputs(input_ids=ids)).logits
    want = gemma2("eager", 2.0)(input_ids=ids, use_cache=False).logits
    uncapped = gemma2("eager", None)(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (uncapped - want).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------------
# 2. gloo world of 2 ranks
# ------------------------------------------------------------------------------------------------------


def _padding_mask() -> torch.Tensor:
    mask = torch.ones(2, SEQ, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[1, -5:] = False  # right padding
    return mask


def _packed_position_ids() -> torch.Tensor:
    lengths = (5, 7, 4)
    return torch.cat([torch.arange(n) for n in lengths])[None]


def _cases():
    """(name, layout, shard_inputs keywords) of every world-2 case, built identically in the parent."""
    ids = _ids()
    padded_labels = ids.masked_fill(~_padding_mask(), -100)
    mask = _padding_mask()
    cumsum = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)  # transformers' generate / training position ids
    return [
        ("contiguous", "contiguous", dict(input_ids=ids, labels=ids)),
        ("zigzag", "zigzag", dict(input_ids=ids, labels=ids)),
        ("padding", "zigzag", dict(input_ids=ids, labels=padded_labels, attention_mask=mask)),
        ("padding_cumsum", "zigzag", dict(input_ids=ids, labels=padded_labels, attention_mask=mask,
                                          position_ids=cumsum)),
        ("padding_striped", "striped", dict(input_ids=ids, labels=padded_labels, attention_mask=mask,
                                            position_ids=cumsum)),
        ("packed", "zigzag", dict(input_ids=_ids(1, seed=2), labels=_ids(1, seed=2), position_ids=_packed_position_ids())),
        ("packed_balanced", "balanced", dict(input_ids=_ids(1, seed=2), labels=_ids(1, seed=2),
                                             position_ids=_packed_position_ids())),
        ("packed_auto", "auto", dict(input_ids=_ids(1, seed=2), labels=_ids(1, seed=2),
                                     position_ids=_packed_position_ids())),
    ]


def _shard(x, layout, world, rank, full):
    """This rank's rows of a full-sequence reference under ``layout`` (the documents' placement for "balanced"
    and "auto", from the packed position ids' restarts)."""
    docs = None
    if "position_ids" in full and layout in ("balanced", "auto"):
        pos = full["position_ids"][0]
        starts = [i for i in range(pos.numel()) if i == 0 or int(pos[i]) == 0]
        docs = tuple(starts) + (pos.numel(),)
    return layouts.shard(x, balance.resolve(layout, x.shape[1], world, docs), world, rank)


def _hf_rank(rank, world, check):
    out = {}
    for name, layout, full in _cases():
        ring = ring_hf.register(f"ring_attention_{name}", layout=layout)
        model = _model(ring.name)
        inputs = ring.shard_inputs(**full)
        with distcomm.check_mode(check):  # check mode must accept every input computed correctly without it
            res = model(**inputs)
        loss = _summed_loss(res.logits, inputs["shift_labels"], inputs["num_items_in_batch"])
        loss.backward()
        out[name] = {
            "logits": res.logits.detach(), "loss": loss.detach(), "hf_loss": res.loss.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()},
        }
    ring = ring_hf.register("ring_attention_window", layout="zigzag")  # Mistral: sliding window of 5
    model = _mistral(ring.name)
    with distcomm.check_mode(check):
        res = model(**ring.shard_inputs(input_ids=_ids()))
    res.logits.sum().backward()
    out["window"] = {"logits": res.logits.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}
    # Local position ids (the model's default) are caught in check mode, on every rank (rank 0's
    # contiguous shard happens to start at 0, so only rank 1's ids are wrong).
    ring = ring_hf.register("ring_attention_check", layout="contiguous")
    local = ring.shard_inputs(input_ids=_ids())["input_ids"]
    out["check_error"] = _error_of(lambda: _model(ring.name)(input_ids=local, use_cache=False))
    # Zigzag shards with the model's own local ids: wrong on both ranks.
    ring = ring_hf.register("ring_attention_check_zigzag", layout="zigzag")
    local = ring.shard_inputs(input_ids=_ids())["input_ids"]
    out["check_error_zigzag"] = _error_of(lambda: _model(ring.name)(input_ids=local, use_cache=False))
    # Packed documents without their boundaries: attention would cross them.
    ring = ring_hf.register("ring_attention_check_packed", layout="zigzag")
    inputs = ring.shard_inputs(input_ids=_ids(1, seed=2), position_ids=_packed_position_ids())
    del inputs["cu_seq_lens_q"], inputs["cu_seq_lens_k"]
    out["check_error_packed"] = _error_of(lambda: _model(ring.name)(**inputs))
    return out


def _error_of(fn):
    """The ValueError ``fn`` raises in check mode, or None."""
    try:
        with distcomm.check_mode():
            fn()
    except ValueError as e:
        return str(e)
    return None


def _reference(name, full):
    """The whole batch on one process with transformers' sdpa attention (its own padding and packed-sequence
    masks), float64 loss with targets written here from the unshifted labels."""
    model = _model("sdpa")
    kwargs = {k: v for k, v in full.items() if k in ("input_ids", "attention_mask", "position_ids")}
    logits = model(**kwargs, use_cache=False).logits
    labels = full["labels"]
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    if name.startswith("packed"):  # the next token must be in the same document
        pos = full["position_ids"].expand_as(labels)
        targets[:, :-1][pos[:, 1:] == 0] = -100
        # the documents matter: with a mask given, transformers does not split them, and logits change
        crossing = _model("sdpa")(**kwargs, attention_mask=torch.ones_like(labels), use_cache=False).logits
        assert (crossing - logits).abs().max() > 1e-3
    count = int((targets != -100).sum())
    loss = _summed_loss(logits, targets, count)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}, targets


@pytest.mark.parametrize("check", [False, True], ids=["unchecked", "check_mode"])
def test_llama_ring_equals_single_process(check):
    """A Llama model with ring attention on 2 ranks == the same weights on the whole batch in one process:
    logits, losses (summed over ranks) and parameter gradients (summed over ranks), for contiguous and zigzag
    shards, padded batches (left and right padding; arange or attention-mask cumsum position ids) and packed
    documents (and a Mistral sliding window across shards), with and without check mode, which must accept all
    of them; local position ids, on contiguous or zigzag shards, and packed documents without their boundaries
    are refused in check mode on every rank."""
    world = 2
    results = run_world(_hf_rank, world, check, timeout=180)
    for name, layout, full in _cases():
        logits, loss, grads, targets = _reference(name, full)
        got = [results[r][name] for r in range(world)]
        for rank, res in enumerate(got):
            want = _shard(logits, layout, world, rank, full)
            if "attention_mask" in full:  # padded queries attend to nothing real: compare real tokens only
                real = layouts.shard(_padding_mask(), layout, world, rank)
                res["logits"], want = res["logits"][real], want[real]
            torch.testing.assert_close(res["logits"], want, **FP64, msg=f"{name} logits rank {rank}")
        torch.testing.assert_close(sum(r["loss"] for r in got), loss, **FP64, msg=f"{name} loss")
        # transformers' own loss (it upcasts logits to float32) follows the same convention
        torch.testing.assert_close(sum(r["hf_loss"] for r in got), loss.float(), rtol=1e-5, atol=1e-6)
        for pname, g in grads.items():
            torch.testing.assert_close(sum(r["grads"][pname] for r in got), g, **FP64, msg=f"{name} grad {pname}")
    model = _mistral("sdpa")  # the sliding window crosses shards: checked against transformers' own mask
    logits = model(input_ids=_ids(), use_cache=False).logits
    logits.sum().backward()
    for rank in range(world):
        torch.testing.assert_close(results[rank]["window"]["logits"], layouts.shard(logits.detach(), "zigzag", world, rank), **FP64)
    for pname, p in model.named_parameters():
        torch.testing.assert_close(sum(results[r]["window"]["grads"][pname] for r in range(world)), p.grad, **FP64)
    assert (_mistral("sdpa", sliding_window=None)(input_ids=_ids(), use_cache=False).logits - logits).abs().max() > 1e-3
    for key, expect in [
        ("check_error", r"position_ids given to the model are not the global positions of the ranks' tokens under "
                        r"layout='contiguous' \(row 0: position id minus global position is 0 on ring position 0, "
                        r"-8 on ring position 1; in each row it must be one constant over the real tokens"),
        ("check_error_zigzag", r"under layout='zigzag' \(row 0: position id minus global position is -8 to 0 on "
                               r"ring position 0, -4 on ring position 1"),
        ("check_error_packed", r"under layout='zigzag' \(row 0: position id minus global position is -12 to 0 on "
                               r"ring position 0, -5 to 0 on ring position 1"),
    ]:
        assert results[0][key] is not None and re.search(expect, results[0][key]), (key, results[0][key])
        assert results[1][key] == results[0][key], key


def _strategies_rank(rank, world):
    out = {}
    from distcomm_attention import Hardware

    slow = Hardware(tflops=1e9, query_tile_s=0.0, key_tile_s=0.0, call_overhead_s=0.0, p2p_gbps=1e-3,
                    a2a_gbps=1e-3, allgather_gbps=1e-3, reduce_scatter_gbps=1e-3, latency_s=0.0)
    for strategy in ("ulysses", "allgather", "auto", "auto on slow links"):
        for name, layout, full in _cases():
            ring = ring_hf.register(f"cp_attention_{strategy.replace(' ', '_')}_{name}", layout=layout,
                                    strategy=strategy.split()[0], hardware=slow if " " in strategy else None)
            model = _model(ring.name)
            inputs = ring.shard_inputs(**full)
            res = model(**inputs)
            loss = _summed_loss(res.logits, inputs["shift_labels"], inputs["num_items_in_batch"])
            loss.backward()
            out[f"{strategy}-{name}"] = {"logits": res.logits.detach(), "loss": loss.detach(),
                                         "grads": {n: p.grad for n, p in model.named_parameters()}}
    return out


def test_llama_strategies_equal_single_process():
    """register(strategy="ulysses" | "allgather" | "auto", and "auto" with a hardware of slow links): the Llama
    model on 2 ranks equals the whole batch in one process (logits, summed losses and parameter gradients) for
    every case of the ring's test."""
    world = 2
    results = run_world(_strategies_rank, world, timeout=240)
    for name, layout, full in _cases():
        logits, loss, grads, _targets = _reference(name, full)
        for strategy in ("ulysses", "allgather", "auto", "auto on slow links"):
            got = [results[r][f"{strategy}-{name}"] for r in range(world)]
            for rank, res in enumerate(got):
                want = _shard(logits, layout, world, rank, full)
                mine = res["logits"]
                if "attention_mask" in full:
                    real = layouts.shard(_padding_mask(), layout, world, rank)
                    mine, want = mine[real], want[real]
                torch.testing.assert_close(mine, want, **FP64, msg=f"{strategy} {name} logits rank {rank}")
            torch.testing.assert_close(sum(r["loss"] for r in got), loss, **FP64, msg=f"{strategy} {name} loss")
            for pname, g in grads.items():
                torch.testing.assert_close(sum(r["grads"][pname] for r in got), g, **FP64,
                                           msg=f"{strategy} {name} grad {pname}")


def test_register_strategy_errors():
    """A strategy the integration cannot run, or ring_size beside a whole-group strategy, is refused by name."""
    with pytest.raises(ValueError, match=r"Invalid strategy 'hybrid'.*'ring', 'ulysses', 'allgather', 'auto'"):
        ring_hf.register("cp_attention_bad_strategy", strategy="hybrid")
    with pytest.raises(ValueError, match=r"`strategy`='ulysses' runs over the whole group: `ring_size`=2"):
        ring_hf.register("cp_attention_bad_ring_size", strategy="ulysses", ring_size=2)
    with pytest.raises(TypeError, match=r"`hardware` must be a distcomm_attention.Hardware or None, got dict"):
        ring_hf.register("cp_attention_bad_hardware", strategy="auto", hardware={"a2a_gbps": 50})


# ------------------------------------------------------------------------------------------------------
# 4. GPUs (marked; run on the GPU machine)
# ------------------------------------------------------------------------------------------------------


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")


def _run_padded(model, inputs: dict) -> tuple[torch.Tensor, dict]:
    """Logits (float32) and parameter grads (float32, CPU) of the summed-loss convention."""
    res = model(**inputs)
    targets = inputs["shift_labels"]
    _summed_loss(res.logits.float(), targets, inputs["num_items_in_batch"]).backward()
    return res.logits.detach().float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}


def _low_precision_rank(rank, world, dtype_name):
    ring = ring_hf.register("ring_attention_low", layout="zigzag")
    model = _model(ring.name).to(device=_device(rank), dtype=getattr(torch, dtype_name))
    ids = _ids().to(_device(rank))
    labels = ids.masked_fill(~_padding_mask().to(ids.device), -100)
    return _run_padded(model, ring.shard_inputs(input_ids=ids, labels=labels, attention_mask=_padding_mask().to(ids.device)))


def _single(attn_implementation: str, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    model = _model(attn_implementation).to(device=_device(0), dtype=dtype)
    ids = _ids().to(_device(0))
    labels = ids.masked_fill(~_padding_mask().to(ids.device), -100)
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    inputs = dict(input_ids=ids, attention_mask=_padding_mask().to(ids.device), use_cache=False,
                  shift_labels=targets, num_items_in_batch=(targets != -100).sum())
    return _run_padded(model, inputs)


def check_low_precision(backend: str, dtype: torch.dtype) -> None:
    """Ring model in ``dtype`` on 2 ranks vs the fp32 model on one process: errors at most 2x those of
    transformers' sdpa in the same dtype on one process (plus 1% of the largest value as a floor)."""
    world = 2
    results = run_world(_low_precision_rank, world, str(dtype).replace("torch.", ""), backend=backend, timeout=300)
    ref_logits, ref_grads = _single("sdpa", torch.float32)
    low_logits, low_grads = _single("sdpa", dtype)
    real = _padding_mask()

    def assert_2x(name, ours, ref, low):
        err, err_low = (ours - ref).abs().max().item(), (low - ref).abs().max().item()
        floor = 1e-2 * ref.abs().max().item()
        assert err <= 2 * err_low + floor, f"{name}: error {err:.3e} > 2 x {err_low:.3e} + {floor:.1e}"

    for rank in range(world):
        keep = layouts.shard(real, "zigzag", world, rank)
        assert_2x(f"logits rank {rank}", results[rank][0][keep],
                  layouts.shard(ref_logits, "zigzag", world, rank)[keep], layouts.shard(low_logits, "zigzag", world, rank)[keep])
    for name, g in ref_grads.items():
        assert_2x(f"grad {name}", sum(r[1][name] for r in results), g, low_grads[name])


@pytest.mark.gpu2
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_ring_on_two_gpus(dtype):
    """On 2 GPUs (NCCL, Triton kernels) the ring model's logits and summed gradients are as accurate as
    transformers' sdpa in the same precision on one GPU, padding included."""
    check_low_precision("nccl", dtype)


def test_mask_patterns_the_ring_does_not_reproduce_are_refused():
    """transformers' mask functions for chunked attention (Llama4), block-wise or OR-ed overlays are refused by
    the mask hook instead of dropped; causal, sliding-window, packed and padding ones pass."""
    from transformers import masking_utils as mu

    ring = ring_hf.register("ring_attention_test_masks")
    mask = torch.ones(1, 8, dtype=torch.bool)
    for fn in (mu.causal_mask_function, mu.sliding_window_causal_mask_function(4),
               mu.and_masks(mu.causal_mask_function, mu.padding_mask_function(mask))):
        assert ring.mask(1, 8, 8, mask_function=fn, attention_mask=mask) is mask
    with pytest.raises(ValueError, match=r"does not reproduce this model's attention mask: chunked attention"):
        ring.mask(1, 8, 8, mask_function=mu.chunked_causal_mask_function(4, 0), attention_mask=mask)
    with pytest.raises(ValueError, match=r"an OR-ed mask overlay"):
        ring.mask(1, 8, 8, mask_function=mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function))


def test_shard_inputs_padding_between_documents_is_a_boundary():
    """A row packing two documents with padding between them (position ids restarting at the second's first
    real token): the restart is a boundary, as after real tokens directly."""
    ring = ring_hf.register("ring_attention_test_mid_pad", layout="contiguous")
    mask = torch.ones(1, SEQ, dtype=torch.long)
    mask[0, 5:8] = 0
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7]])
    got = ring.shard_inputs(input_ids=_ids(1), position_ids=pos, attention_mask=mask)
    assert got["cu_seq_lens_q"].tolist() == [0, 8, SEQ]


def test_shard_inputs_left_padding_is_not_a_document_boundary():
    """transformers numbers a left-padded row from 0 at its first real token: that restart follows padding and
    is not a packed-document boundary (rows padded differently are an ordinary batch)."""
    ring = ring_hf.register("ring_attention_test_left_pad", layout="contiguous")
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, :2] = 0
    mask[1, :1] = 0
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    got = ring.shard_inputs(input_ids=_ids(2), position_ids=pos, attention_mask=mask)
    assert "cu_seq_lens_q" not in got
    packed = pos.clone()
    packed[:, 9] = 0  # a real restart after real tokens in both rows: a document boundary
    got = ring.shard_inputs(input_ids=_ids(2), position_ids=packed, attention_mask=mask)
    assert got["cu_seq_lens_q"].tolist() == [0, 9, SEQ]
