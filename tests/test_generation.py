"""Cached decoding against the plain forward: same logits, same greedy tokens, for every kind."""

import copy
import itertools
import math

import pytest
import torch
from kinds import model_rows

from lm import GenerationError, ModelConfig, Transformer, generate, stream
from lm.attention.cache import held_bytes
from lm.generation.decode import Sampling
from lm.model.generation_cache import GenerationCache

KINDS = model_rows()  # name -> (the model's attention, n_kv_head); 2 layers, 4 heads
VOCAB = 53
# The model's short convolution before attention (model.short_conv) over one kind of each cache:
# full K/V, a ring, recurrent states (one with its own convolution), the latent, a hybrid.
WITH_CONV = [f"{name}+conv" for name in ("softmax-gqa", "sliding-wrapped", "linear", "gated_delta", "mla",
                                         "hybrid-efficient-softmax")]


def make_model(name, max_seq_len=64):
    """The kind's 2-layer test model; `<kind>+conv` adds a 3-tap short convolution before attention."""
    kind, _, conv = name.partition("+")
    attention, n_kv_head = KINDS[kind]
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, n_layer=2, d_model=32, n_head=4, n_kv_head=n_kv_head, d_ff=64,
                      max_seq_len=max_seq_len, attention=attention, init_std=0.1, short_conv=3 if conv else 0)
    return Transformer(cfg).eval()


@pytest.mark.parametrize("name", list(KINDS) + WITH_CONV)
def test_cached_logits_match_the_full_forward(name):
    """Prefill in uneven chunks, then token by token: every position's logits as one forward."""
    model = make_model(name)
    idx = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        full = model(idx)  # (2, 40, V)
        cache = GenerationCache(model, pad=torch.zeros(2, dtype=torch.long), max_len=40)
        pieces = [model(idx[:, a:b], cache=cache) for a, b in ((0, 13), (13, 14), (14, 30))]
        pieces += [model(idx[:, t:t + 1], cache=cache) for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-4, rtol=1e-4)


def rounded_twin(model: Transformer) -> Transformer:
    """The float model with every nn.Linear weight replaced by its int8 rounding times its scale: what
    an int8 model computes, written with the plain float layers."""
    from lm.generation.quantize import quantize_per_channel

    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, torch.nn.Linear):
            q, scales = quantize_per_channel(module.weight)
            # a new tensor: a head tied to the embedding is rounded, the embedding it shared stays float
            module.weight = torch.nn.Parameter(q.float() * scales[:, None])
    return twin


@pytest.mark.parametrize("name", list(KINDS) + WITH_CONV)
def test_int8_weights_decode_every_kind_as_its_rounded_float_twin(name):
    """Every kind quantizes at its settings (KDA's gate bias too): the int8 model's cached decoding
    gives the logits of the float model whose weights are the rounded ones. How far rounding moves a
    kind's logits is the kind's own sensitivity, not the kernel's (lm.generation.quantize)."""
    from lm import quantize_int8

    model = make_model(name)
    quantized = quantize_int8(model, "dequant")
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = rounded_twin(model)(idx)  # (2, 24, V)
        cache = GenerationCache(quantized, pad=torch.zeros(2, dtype=torch.long), max_len=24)
        pieces = [quantized(idx[:, :11], cache=cache)]
        pieces += [quantized(idx[:, t:t + 1], cache=cache) for t in range(11, 24)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(KINDS) + WITH_CONV)
def test_greedy_tokens_with_cache_equal_recomputing_the_prefix(name):
    model = make_model(name)
    prompt = torch.randint(0, VOCAB, (1, 9))
    cached = generate(model, prompt, 30)
    recomputed = generate(model, prompt, 30, use_cache=False)
    assert cached == recomputed and len(cached[0]) == 39


@pytest.mark.parametrize("name", list(KINDS) + WITH_CONV)
def test_batched_prompts_of_different_lengths_decode_as_alone(name):
    model = make_model(name)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 9)]
    batched = generate(model, prompts, 20)
    alone = [generate(model, [p], 20)[0] for p in prompts]
    assert batched == alone


def test_linear_state_through_a_long_prompt_and_a_ring_past_the_context():
    """Sliding and linear models decode past max_seq_len with state that does not grow."""
    for name in ("linear", "sliding-wrapped", "efficient", "sliding-sinks"):
        model = make_model(name, max_seq_len=16)
        prompt = torch.randint(0, VOCAB, (1, 50))  # longer than the context, in one prefill
        run = stream(model, prompt, 30)
        tokens = [t for t in run]
        assert len(tokens) == 30
        assert run.tokens == generate(model, prompt, 30, use_cache=False)
        sizes = []
        for n in (10, 200):
            r = stream(model, prompt, n)
            list(r)
            sizes.append(r.stats["cache_bytes"])
        assert sizes[0] == sizes[1] > 0


def test_cache_bytes_follow_the_kv_heads():
    def cache_bytes(name):
        run = stream(make_model(name), [[1, 2, 3]], 5)
        list(run)
        return run.stats["cache_bytes"]

    mha, gqa, mqa = (cache_bytes(f"softmax-{name}") for name in ("mha", "gqa", "mqa"))
    assert mha == 4 * mqa and mha == 2 * gqa  # n_kv_head / n_head of MHA, byte for byte


def test_full_attention_stops_at_its_context_or_truncates_left():
    model = make_model("softmax-mha", max_seq_len=16)
    with pytest.raises(GenerationError, match="exceeds the model's context of 16"):
        generate(model, [list(range(10))], 10)
    out = generate(model, [list(range(10))], 10, truncate="left")
    assert out[0][:6] == list(range(4, 10)) and len(out[0]) == 16


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
    (dict(top_p=1.5), "top_p=1.5 must be in (0, 1]"),
    (dict(top_p=True), "top_p=True must be in (0, 1]"),
    (dict(temperature=-0.1), "temperature=-0.1 must be a finite number >= 0"),
    (dict(repetition_penalty=math.inf), "repetition_penalty=inf must be a finite number > 0"),
    (dict(max_new_tokens=-1), "max_new_tokens=-1 must be an integer >= 0"),
    (dict(idx=[[]]), "prompt 0 is empty"),
    (dict(stop=["\n"]), "stop strings need the tokenizer"),
    (dict(stop=[""]), "stop=[...] holds an empty string"),
    (dict(seed=-1), "seed=-1 must be null or an integer from 0 to 2**63-1"),
    (dict(eos_id="x"), "eos_id='x' must be an integer from 0 to 52"),
    (dict(eos_id=VOCAB), "eos_id=53 must be an integer from 0 to 52"),
    (dict(use_cache="no"), "use_cache='no' must be true or false"),
    (dict(idx="def f():"), "idx='def f():' is text: encode it"),
    (dict(idx=[1, 2, 3]), "idx is a flat list of ints: give a list of token-id lists or a (B, T) LongTensor"),
    (dict(idx=None), "idx is None: give a list of token-id lists"),
    (dict(idx=torch.tensor([[1.0, 2.0]])), "idx is a torch.float32 tensor, not token ids"),
    (dict(idx=[[1, 2.5]]), "prompt 0 holds 2.5, not a token id"),
    (dict(idx=[[1], [2, -1]]), "prompt 1 holds token id -1, outside the model's vocabulary (vocab_size=53: ids 0 to"),
    (dict(idx=torch.tensor([[1, VOCAB]])), "prompt 0 holds token id 53, outside the model's vocabulary"),
    (dict(max_new_tokens=10**12), "max_new_tokens=1000000000000 exceeds the model's context of 64"),
    (dict(max_new_tokens=10**12, truncate="left"), "max_new_tokens=1000000000000 leaves no room for a prompt"),
])
def test_bad_generation_settings_are_one_line_errors(kwargs, message):
    args = {"idx": [[1, 2]], "max_new_tokens": 3, **kwargs}
    with pytest.raises(GenerationError) as err:
        generate(make_model("softmax-mha"), **args)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("model, message", [
    ("LOADED", "lm.load returns (model, tokenizer): pass the model"),
    (None, "model is None, not an lm Transformer"),
])
def test_what_is_not_a_model_is_named(model, message):
    if model == "LOADED":
        model = (make_model("softmax-mha"), object())  # what lm.load returns
    with pytest.raises(GenerationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        list(stream(model, [[1, 2]], 3))


def test_sampling_filters_keep_what_they_promise():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = torch.zeros(1, 4, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    draw = lambda s: {int(s.pick(logits, seen, g)) for _ in range(300)}  # noqa: E731
    assert draw(Sampling(temperature=1.0, top_k=2)) == {0, 1}
    assert draw(Sampling(temperature=1.0, top_p=0.7)) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert draw(Sampling(temperature=1.0, min_p=0.5)) == {0, 1}  # p >= 0.25
    assert draw(Sampling(temperature=1.0)) == {0, 1, 2, 3}
    assert int(Sampling().pick(logits, seen, None)) == 0
    # A repetition penalty moves greedy off a token already seen.
    assert int(Sampling(repetition_penalty=3.0).pick(logits, torch.tensor([[True, False, False, False]]), None)) == 1


def reference_distribution(logits, seen, temperature, top_k=None, top_p=None, min_p=None, penalty=None):
    """The sampling rules written plainly in float64, for values float64 carries."""
    x = logits.double()
    if penalty is not None:
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    x = x / temperature
    if top_k is not None:
        x = x.masked_fill(x < x.topk(top_k).values[:, -1:], -math.inf)
    probs = x.softmax(-1)
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0)
    if top_p is not None:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    return probs / probs.sum(-1, keepdim=True)


LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, -3.0]])
SEEN = torch.tensor([[False, True, True, True, True, False]])


@pytest.mark.parametrize("settings", [
    dict(temperature=0.7, top_k=3, penalty=1.3), dict(temperature=1.0, top_p=0.6), dict(temperature=2.0, min_p=0.2,
                                                                                      penalty=0.8),
    dict(temperature=0.5, penalty=4.0, top_p=0.95, top_k=5),
])
def test_sampling_gives_the_plain_float64_distribution(settings):
    sampling = Sampling(settings["temperature"], settings.get("top_k"), settings.get("top_p"), settings.get("min_p"),
                        settings.get("penalty"))
    expected = reference_distribution(LOGITS, SEEN, **settings).float()
    torch.testing.assert_close(sampling.distribution(LOGITS, SEEN), expected, atol=1e-6, rtol=1e-5)


def one_hot(i):
    return torch.nn.functional.one_hot(torch.tensor([i]), LOGITS.shape[1]).float()


@pytest.mark.parametrize("sampling, expected", [
    (Sampling(temperature=1e-45), one_hot(0)),  # float32's smallest: 1/T overflows
    (Sampling(temperature=1e-300), one_hot(0)),  # float32 rounds it to 0: greedy is the limit
    (Sampling(temperature=1e39), torch.full((1, 6), 1 / 6)),  # float32 rounds it to inf: uniform is the limit
    (Sampling(temperature=1e300), torch.full((1, 6), 1 / 6)),
    (Sampling(temperature=1.0, top_p=1e-320), one_hot(0)),  # float32 rounds top_p to 0: the best token stays
    (Sampling(temperature=1.0, top_k=10**20), LOGITS.softmax(-1)),  # beyond the vocabulary: no filter
    (Sampling(temperature=1.0, min_p=1e-320), LOGITS.softmax(-1)),
    # A tiny penalty boosts the seen positive logits past float32; the largest of them (token 1) wins.
    (Sampling(temperature=1.0, repetition_penalty=1e-300), one_hot(1)),
    (Sampling(temperature=1e300, repetition_penalty=1e-300), one_hot(1)),
    # A huge one sends seen positive logits to 0 and seen negative ones (tokens 3) to -inf; token 4's 0 stays 0.
    (Sampling(temperature=1.0, repetition_penalty=1e300),
     torch.tensor([[2.0, 0.0, 0.0, -math.inf, 0.0, -3.0]]).softmax(-1)),
])
def test_extreme_accepted_values_give_their_limit(sampling, expected):
    probs = sampling.distribution(LOGITS, SEEN)
    assert not probs.isnan().any()
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)


def test_greedy_takes_an_extreme_penalty_to_its_limit():
    assert int(Sampling(repetition_penalty=1e-300).pick(LOGITS, SEEN, None)) == 1  # the best boosted logit
    assert int(Sampling(repetition_penalty=1e300).pick(LOGITS, SEEN, None)) == 0
    assert int(Sampling(repetition_penalty=1e300).pick(LOGITS, torch.ones_like(SEEN), None)) == 0  # 2/1e300 > 0


def test_extreme_values_run_through_generate():
    model = make_model("softmax-gqa")
    greedy = generate(model, [[1, 2, 3]], 12)
    assert generate(model, [[1, 2, 3]], 12, temperature=1e-300, seed=0) == greedy
    assert generate(model, [[1, 2, 3]], 12, temperature=1.0, top_p=1e-320, seed=0) == greedy
    for extreme in (dict(temperature=1e300), dict(temperature=1.0, repetition_penalty=1e-300),
                    dict(repetition_penalty=1e300, temperature=1.0)):
        assert len(generate(model, [[1, 2, 3]], 12, seed=0, **extreme)[0]) == 15


def test_seed_reproduces_a_sampled_run():
    model = make_model("softmax-gqa")
    a = generate(model, [[1, 2, 3]], 20, temperature=1.0, top_k=20, seed=7)
    b = generate(model, [[1, 2, 3]], 20, temperature=1.0, top_k=20, seed=7)
    c = generate(model, [[1, 2, 3]], 20, temperature=1.0, top_k=20, seed=8)
    assert a == b and a != c


def held_numel(cache) -> int:
    """Numbers in every tensor a GenerationCache and its layers hold."""
    total = 0
    for holder in (cache, *cache.layers):
        for value in vars(holder).values():
            tensors = value if isinstance(value, (tuple, list)) else (value,)
            total += sum(t.numel() for t in tensors if isinstance(t, torch.Tensor))
    return total


CONSTANT_STATE = ["linear", "efficient", "gated_delta", "sliding-wrapped", "sliding-sinks", "hybrid-linear-sliding"]


@pytest.mark.parametrize("name", CONSTANT_STATE)
def test_a_constant_state_kind_starts_any_length_without_allocating_for_it(name):
    """max_new_tokens sizes nothing up front: the caches hold the same numbers for 10 new tokens as
    for 10**12, and a run of 10**9 or 10**12 decodes its first steps at once."""
    model = make_model(name, max_seq_len=16)
    assert not model.context_limited
    held = None
    for n in (10, 10**5, 10**9, 10**12):
        run = stream(model, [[1, 2, 3], [4]], n)
        assert len(list(itertools.islice(run, 3))) == 3
        held = held or held_numel(run.cache)
        assert held_numel(run.cache) == held, f"max_new_tokens={n}"


def test_stop_string_and_eos_end_a_row():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(ord("a") + i): i for i in range(26)} | {"<eos>": 26}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    model = make_model("softmax-mha")
    free = generate(model, [[0, 1]], 20)[0][2:]
    text = tokenizer.decode(free)
    stop = text[5:7]
    stopped = generate(model, [[0, 1]], 20, stop=[stop], tokenizer=tokenizer)[0][2:]
    assert stop in tokenizer.decode(stopped) and len(stopped) < 20
    assert free[:len(stopped)] == stopped
    eos = free[4]
    ended = generate(model, [[0, 1]], 20, eos_id=eos)[0][2:]
    assert ended == free[:free.index(eos)]


# ---------------------------------------------------------------- the fixed-shape decoding step


class NoHostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any read of a tensor's value by Python (.item(), bool(), .tolist() all end in
    aten._local_scalar_dense): inside a decoding step, each would be a device sync."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("the decoding step read a tensor value on the host")
        return func(*args, **(kwargs or {}))


def prefill_ragged(model, prompts, max_len):
    """Left-pad `prompts` into a batch and prefill a cache: (cache, logits of the last position)."""
    width = max(map(len, prompts))
    pad = torch.tensor([width - len(p) for p in prompts])
    batch = torch.stack([torch.tensor([0] * (width - len(p)) + p) for p in prompts])
    cache = GenerationCache(model, pad=pad, max_len=max_len)
    return cache, model(batch, cache=cache)[:, -1]


@pytest.mark.parametrize("name", list(KINDS) + WITH_CONV)
def test_the_decoding_step_matches_each_row_alone_and_never_syncs(name):
    """decode_step on a ragged batch: each row's logits equal that row's full forward, at every
    step, and no step reads a tensor value on the host."""
    model = make_model(name)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 7)]
    extra = torch.randint(0, VOCAB, (3, 14), generator=g)  # the tokens fed step by step
    with torch.no_grad():
        cache, _ = prefill_ragged(model, prompts, max_len=11 + 14)
        steps = []
        for t in range(extra.shape[1]):
            with NoHostReads():
                steps.append(model.decode_step(extra[:, t:t + 1], cache, torch.tensor(cache.seen)))
            cache.advance(1)
        for row, p in enumerate(prompts):
            full = model(torch.tensor([p + extra[row].tolist()]))[0, len(p):]  # (14, V)
            torch.testing.assert_close(torch.stack([s[row] for s in steps]), full, atol=1e-4, rtol=1e-4)


def decode_steps(model, cache, tokens):
    """Feed tokens (B, n) one step at a time, each row at its own slot; the logits of each step."""
    steps = []
    for t in range(tokens.shape[1]):
        with NoHostReads():
            steps.append(model.decode_step(tokens[:, t:t + 1], cache, cache.lengths.clone()))  # (B, V)
        cache.advance(1)
    return steps


@pytest.mark.parametrize("name", list(KINDS) + WITH_CONV)
def test_a_row_is_reset_and_prefilled_alone_while_the_others_keep_decoding(name):
    """What a server admitting and freeing requests row by row needs, on every kind's cache: after a
    few steps row 1 is freed (reset_row: as a new cache's row, the others untouched) and a new prompt
    is prefilled into it alone (prefill_row); then the three rows decode side by side, each at its
    own slot. Row 1 gives what a fresh single-row cache of its prompt gives, rows 0 and 2 what the
    same batch gives when nothing happens to row 1, in float64 to rounding."""
    model = make_model(name).double()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 7)]
    before, after = torch.randint(0, VOCAB, (3, 4), generator=g), torch.randint(0, VOCAB, (3, 6), generator=g)
    new_prompt = torch.randint(0, VOCAB, (9,), generator=g)
    with torch.no_grad():
        cache, _ = prefill_ragged(model, prompts, max_len=24)
        decode_steps(model, cache, before)
        for tensor in cache.held_tensors():
            assert tensor.shape[0] == 3, "a declared tensor must hold the batch's rows first"
        kept = [{key: t.clone() for key, t in part.tensors().items()} for part in cache.parts() if part is not None]
        cache.reset_row(1)
        empty = cache.single_row()
        for part, old, new in zip([p for p in cache.parts() if p is not None], kept,
                                  [p for p in empty.parts() if p is not None], strict=True):
            for key, tensor in part.tensors().items():
                assert torch.equal(tensor[1], new.tensors()[key][0]), f"{key} of row 1 is not reset"
                assert torch.equal(tensor[0::2], old[key][0::2]), f"{key} of rows 0 and 2 changed"
        prefill_logits = cache.prefill_row(1, new_prompt)
        assert cache.row_slots == [15, 9, 15] and not cache.aligned
        steps = torch.stack(decode_steps(model, cache, after), dim=1)  # (3, 6, V)

        alone = GenerationCache(model, pad=torch.zeros(1, dtype=torch.long), max_len=24)
        torch.testing.assert_close(prefill_logits, model(new_prompt[None], cache=alone)[0], atol=1e-9, rtol=1e-9)
        alone_steps = torch.stack(decode_steps(model, alone, after[1:2]), dim=1)  # (1, 6, V)
        torch.testing.assert_close(steps[1], alone_steps[0], atol=1e-9, rtol=1e-9)
        untouched, _ = prefill_ragged(model, prompts, max_len=24)
        decode_steps(model, untouched, before)
        untouched_steps = torch.stack(decode_steps(model, untouched, after), dim=1)  # (3, 6, V)
        torch.testing.assert_close(steps[0::2], untouched_steps[0::2], atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="different slots"):
        model(torch.zeros(3, 2, dtype=torch.long), cache=cache)  # a batch prefill needs aligned rows


@pytest.mark.parametrize("name", list(KINDS))
def test_each_layer_holds_what_it_declares(name):
    """generation_state() (what the benchmarks report) against the built cache's nbytes(), after
    a prompt and some decoded tokens, for a batch of 2."""
    model = make_model(name)
    cache = GenerationCache(model, pad=torch.zeros(2, dtype=torch.long), max_len=40)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (2, 30)), cache=cache)
        cache.advance(30)
    for block, layer_cache in zip(model.blocks, cache.layers, strict=True):
        assert held_bytes(layer_cache) == 4 * block.attn.generation_state().numel(40, batch=2)


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_comes_back_from_a_checkpoint_with_the_same_logits(name, tmp_path):
    from lm import load
    from lm.data.tokenizer import train_tokenizer
    from lm.formats.checkpoint import save_checkpoint

    attention, n_kv_head = KINDS[name]
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=300, n_layer=2, d_model=32, n_head=4, n_kv_head=n_kv_head, d_ff=64,
                                    max_seq_len=64, attention=attention, init_std=0.1)).eval()
    tokenizer = train_tokenizer(iter(["abc def " * 20]), 300)  # byte-level BPE needs 257 ids at least
    path = save_checkpoint(tmp_path / "last.ckpt", model.state_dict(), model.config, tokenizer.to_str())
    loaded, _ = load(path)
    assert loaded.config == model.config  # every option of every layer stored, defaults resolved
    idx = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))


def test_a_compiled_prefill_runs_once_and_the_later_chunks_of_a_long_prompt_run_eagerly(monkeypatch):
    """The cache's fill level is a constant of a compiled graph: compiling each later chunk would
    cost a compilation per chunk for one use, so only the first chunk goes through it."""
    import lm.generation.decode as decode

    model = make_model("softmax-gqa")
    calls = []

    def counting(m, compile_mode):
        def prefill(idx, cache):
            calls.append(idx.shape[1])
            return m(idx, cache=cache)
        return prefill, m.decode_step

    monkeypatch.setattr(decode, "compiled_functions", counting)
    prompt = list(range(1, 41))
    compiled = decode.Generation(model, [prompt], 6, Sampling(), prefill_chunk=16, compile=True)
    eager = decode.Generation(model, [prompt], 6, Sampling(), prefill_chunk=16)
    assert [t for step in compiled for t in step] == [t for step in eager for t in step]
    assert calls == [16]  # chunks of 16, 16 and 8: the first through the compiled prefill only


class WrittenStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the storage of every tensor an op writes in place (its schema marks the argument
    written; a list of tensors too), and of every tensor an op makes afresh (a return its schema does
    not alias to an argument, unless it is an argument's storage all the same, as `unsafe_chunk` and
    `_unsafe_view` return), so that what was written minus what was made is what the ops wrote of
    tensors that existed before them. Every storage recorded is kept alive while the mode lives, so
    no later one takes its address."""

    def __init__(self):
        super().__init__()
        self.written, self.made, self.kept = set(), set(), []

    @staticmethod
    def tensors(value) -> list[torch.Tensor]:  # an argument or a return: a tensor, or a list of them
        if isinstance(value, torch.Tensor):
            return [value]
        return [t for t in value if isinstance(t, torch.Tensor)] if isinstance(value, (list, tuple)) else []

    def record(self, into: set, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            into.add(t.untyped_storage().data_ptr())
            self.kept.append(t.untyped_storage())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = set()
        for i, argument in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            tensors = self.tensors(value)
            inputs.update(t.untyped_storage().data_ptr() for t in tensors)
            if argument.alias_info is not None and argument.alias_info.is_write:
                self.record(self.written, tensors)
        out = func(*args, **kwargs)
        returns = func._schema.returns
        for returned, value in zip(returns, (out,) if len(returns) == 1 else out or (), strict=True):
            if returned.alias_info is None:
                self.record(self.made, [t for t in self.tensors(value) if t.untyped_storage().data_ptr() not in inputs])
        return out


@pytest.mark.parametrize("name", list(KINDS) + WITH_CONV)
def test_every_buffer_the_decoding_step_writes_is_one_the_cache_holds(name):
    """The cache's parts declare what they hold (`tensors()`); on CUDA the cache marks those as static
    addresses, the only inputs a CUDA graph may write in place, and the row operations copy them:
    the step must write nothing else (a tensor it wrote outside the declaration would make inductor
    skip the graph, and be left behind when a row is replaced)."""
    model = make_model(name)
    with torch.no_grad():
        cache, _ = prefill_ragged(model, [[1, 2, 3], [4, 5, 6, 7, 8]], max_len=12)
        held = {t.untyped_storage().data_ptr() for t in cache.held_tensors()}
        for token in range(3):
            idx, pos = torch.full((2, 1), token), torch.tensor(cache.seen)
            with WrittenStorages() as spy:
                model.decode_step(idx, cache, pos)
            cache.advance(1)
            # a storage the step made is its own temporary; any other it wrote existed before the step
            # (a parameter, a cache buffer, a tensor some module keeps), and must be one the cache holds
            written = spy.written - spy.made
            assert written, "the step wrote no cache buffer"
            assert written <= held, f"{len(written - held)} written inputs that the cache does not hold"
            # and in place: a buffer the step replaced would leave a CUDA graph's static address behind
            assert {t.untyped_storage().data_ptr() for t in cache.held_tensors()} == held
