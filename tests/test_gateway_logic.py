"""Gateway request logic: validation and fan-out, detokenization, stop strings, output merging."""

from __future__ import annotations

import math
import random

import pytest

from strata.default_model import build_tiny_tokenizer
from strata.services.gateway.detokenizer import IncrementalDetokenizer, OutputTextStream, StopChecker
from strata.services.gateway.fanout import RequestOutputState, child_requests
from strata.services.gateway.validation import InvalidRequest, ValidatedParams, validate_request
from strata.v1 import generate_pb2

VOCAB = 1000
MAX_LEN = 64

# Texts whose characters are missing from the tokenizer's training text, so their UTF-8 bytes
# are split over several tokens.
SPLIT_TEXTS = [
    "日本語のテキストです。",
    "Party 🎉🎊 time, family 👩‍👩‍👧 and flags 🇫🇷!",
    "Ça dépend: naïve façade, Straße, Ærø, ñandú — “quoted” ½ ≠ ∞.",
    "mixed 中文 and English, émoji 🙂 then plain words again.\nnew line",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


# ---------------------------------------------------------------- validation


def make_request(prompt_ids=(1, 2, 3), text=None, **params) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(request_id="r", params=generate_pb2.SamplingParams(**params))
    if text is not None:
        req.prompt = text
    elif prompt_ids is not None:
        req.prompt_token_ids.ids.extend(prompt_ids)
    return req


def validate(req, prompt_ids=None, **kwargs) -> ValidatedParams:
    if prompt_ids is None:
        prompt_ids = list(req.prompt_token_ids.ids)
    return validate_request(req, prompt_ids, vocab_size=VOCAB, max_model_len=MAX_LEN, **kwargs)


BAD_PARAMS = [
    ("params.temperature", dict(temperature=-0.5)),
    ("params.temperature", dict(temperature=math.nan)),
    ("params.temperature", dict(temperature=math.inf)),
    ("params.top_p", dict(top_p=0.0)),
    ("params.top_p", dict(top_p=1.5)),
    ("params.top_p", dict(top_p=math.nan)),
    ("params.top_k", dict(top_k=-2)),
    ("params.min_p", dict(min_p=-0.1)),
    ("params.min_p", dict(min_p=1.5)),
    ("params.n", dict(n=257)),
    ("params.max_tokens", dict(max_tokens=0)),
    ("params.max_tokens", dict(max_tokens=MAX_LEN - 3 + 1)),  # prompt is 3 tokens
    ("params.min_tokens", dict(max_tokens=5, min_tokens=6)),
    ("params.min_tokens", dict(min_tokens=MAX_LEN)),  # more than the default can grow to
    ("params.logprobs", dict(logprobs=21)),
    ("params.stop", dict(stop=["ok", ""])),
    ("params.stop_token_ids", dict(stop_token_ids=[5, VOCAB])),
    ("params.stop_token_ids", dict(stop_token_ids=[-1])),
    ("params.output_kind", dict(output_kind=7)),
]


@pytest.mark.parametrize("field,params", BAD_PARAMS, ids=[f"{f}-{p}" for f, p in BAD_PARAMS])
def test_bad_params_name_their_field(field, params):
    with pytest.raises(InvalidRequest) as info:
        validate(make_request(**params))
    assert info.value.field == field
    assert field in str(info.value)


def test_message_says_what_was_wrong():
    with pytest.raises(InvalidRequest, match=r"^params\.top_p must be in \(0, 1\], got 1\.5$"):
        validate(make_request(top_p=1.5))


@pytest.mark.parametrize(
    "req,prompt_ids,field",
    [
        (make_request(prompt_ids=None), [], "prompt"),
        (make_request(text=""), [], "prompt"),
        (make_request(prompt_ids=[]), [], "prompt_token_ids"),
        (make_request(prompt_ids=[1, VOCAB]), None, "prompt_token_ids"),
        (make_request(prompt_ids=[-1, 2]), None, "prompt_token_ids"),
        (make_request(prompt_ids=[1] * MAX_LEN), None, "prompt_token_ids"),
        (make_request(text="long"), [1] * MAX_LEN, "prompt"),
        (make_request(text="odd tokenizer"), [1, VOCAB + 3], "prompt"),
    ],
)
def test_bad_prompts_name_their_field(req, prompt_ids, field):
    with pytest.raises(InvalidRequest) as info:
        validate(req, prompt_ids)
    assert info.value.field == field
    assert field in str(info.value)


def test_defaults_are_resolved():
    params = validate(make_request())
    assert params == ValidatedParams(
        n=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        seed=None,
        max_tokens=16,
        min_tokens=0,
        stop=(),
        stop_token_ids=(),
        ignore_eos=False,
        logprobs=None,
        output_kind=generate_pb2.CUMULATIVE,
        skip_special_tokens=False,
    )


def test_explicit_values_and_boundaries_pass():
    params = validate(
        make_request(
            n=256,
            temperature=0.0,
            top_p=1.0,
            top_k=-1,
            min_p=1.0,
            seed=0,
            max_tokens=MAX_LEN - 3,  # prompt + max_tokens == max_model_len exactly
            min_tokens=MAX_LEN - 3,
            stop=["\n\n"],
            stop_token_ids=[0, VOCAB - 1],
            ignore_eos=True,
            logprobs=0,
            output_kind=generate_pb2.FINAL_ONLY,
            skip_special_tokens=True,
        )
    )
    assert (params.n, params.temperature, params.top_k, params.min_p) == (256, 0.0, 0, 1.0)
    assert params.seed == 0 and params.logprobs == 0  # zero is a value, not "unset"
    assert params.max_tokens == MAX_LEN - 3
    assert params.stop == ("\n\n",) and params.stop_token_ids == (0, VOCAB - 1)
    assert params.output_kind == generate_pb2.FINAL_ONLY and params.skip_special_tokens


def test_tiny_temperature_is_greedy():
    assert validate(make_request(temperature=1e-7)).temperature == 0.0
    assert validate(make_request(temperature=0.5)).temperature == pytest.approx(0.5)


def test_unset_max_tokens_shrinks_to_fit_and_grows_for_min_tokens():
    prompt = [1] * (MAX_LEN - 5)
    assert validate(make_request(prompt_ids=prompt)).max_tokens == 5
    assert validate(make_request(min_tokens=20)).max_tokens == 20
    # An explicit max_tokens is never silently capped.
    with pytest.raises(InvalidRequest, match="params.max_tokens"):
        validate(make_request(prompt_ids=prompt, max_tokens=6))


def test_validation_limits_are_configurable():
    with pytest.raises(InvalidRequest, match="params.n"):
        validate(make_request(n=3), max_n=2)
    assert validate(make_request(logprobs=30), max_logprobs=30).logprobs == 30


def test_children_of_a_seeded_request_get_seed_plus_index():
    params = validate(make_request(n=3, seed=41, top_k=-1, logprobs=2, stop=["x"]))
    children = child_requests("req", params, [4, 5, 6])
    assert [c.request_id for c in children] == ["0_req", "1_req", "2_req"]
    assert all(c.parent_id == "req" for c in children)
    assert [c.sampling.seed for c in children] == [41, 42, 43]
    for child in children:
        assert list(child.prompt_token_ids) == [4, 5, 6]
        assert child.sampling.top_k == 0 and child.sampling.temperature == 1.0 and child.sampling.top_p == 1.0
        assert child.sampling.logprobs == 2
        # The defaults are resolved once, here; stop strings stay with the gateway.
        assert child.stop.max_tokens == 16 and child.stop.min_tokens == 0


def test_child_seeds_wrap_at_64_bits():
    params = validate(make_request(n=3, seed=2**64 - 2))
    assert [c.sampling.seed for c in child_requests("r", params, [1])] == [2**64 - 2, 2**64 - 1, 0]


def test_unseeded_children_get_independent_seeds():
    params = validate(make_request(n=8))
    children = child_requests("r", params, [1])
    seeds = [c.sampling.seed for c in children]
    assert len(set(seeds)) == 8
    again = [c.sampling.seed for c in child_requests("r", params, [1])]
    assert again != seeds  # fresh randomness per request
    assert children[0].sampling.logprobs == -1  # none asked
    # An explicit rng makes it reproducible (tests, offline batches).
    a = [c.sampling.seed for c in child_requests("r", params, [1], rng=random.Random(7))]
    b = [c.sampling.seed for c in child_requests("r", params, [1], rng=random.Random(7))]
    assert a == b and len(set(a)) == 8


# ---------------------------------------------------------------- detokenizer


def stream_text(tokenizer, prompt_ids, ids, chunks, skip_special_tokens=False):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    pieces = []
    pos = 0
    for size in chunks:
        pieces.append(detok.push(ids[pos : pos + size]))
        pos += size
    assert pos == len(ids)
    pieces.append(detok.flush())
    return pieces


def random_chunks(rng, total):
    chunks = []
    while total:
        size = min(total, rng.randint(1, 4))
        chunks.append(size)
        total -= size
    return chunks


def test_split_texts_really_split_characters(tokenizer):
    # The premise of the next tests: some single tokens decode to half a character.
    for text in SPLIT_TEXTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids), text


@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_streamed_text_equals_whole_decode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    prompt = tokenizer("Tell me something:").input_ids
    rng = random.Random(text)
    for chunks in ([1] * len(ids), random_chunks(rng, len(ids)), [len(ids)]):
        pieces = stream_text(tokenizer, prompt, ids, chunks)
        assert "".join(pieces) == tokenizer.decode(ids) == text
        assert not any("\ufffd" in piece for piece in pieces)


def test_split_character_is_held_until_complete(tokenizer):
    ids = tokenizer("🎉", add_special_tokens=False).input_ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id], False)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🎉"


@pytest.mark.parametrize("skip", [False, True])
def test_special_tokens_follow_skip_flag(tokenizer, skip):
    words = tokenizer(" old lighthouse 🎉", add_special_tokens=False).input_ids
    ids = words + [tokenizer.eos_token_id] + words + [tokenizer.bos_token_id]
    pieces = stream_text(tokenizer, [tokenizer.bos_token_id], ids, [1] * len(ids), skip)
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) == expected
    assert ("<|end_of_text|>" in expected) is not skip


def test_invalid_bytes_survive_and_flush(tokenizer):
    # A model may emit byte tokens that never form a character; they decode to U+FFFD like
    # the whole decode does, and a trailing one comes out at finish.
    ids = tokenizer("é", add_special_tokens=False).input_ids
    lone = tokenizer.convert_tokens_to_ids("Ã")  # byte 0xC3: starts a 2-byte char
    stray = [lone] + tokenizer(" ok", add_special_tokens=False).input_ids + [lone]
    pieces = stream_text(tokenizer, [], ids + stray, [1] * len(ids + stray))
    assert "".join(pieces) == tokenizer.decode(ids + stray)
    assert pieces[-1] == "\ufffd"  # held until flush


def test_prompt_ending_inside_a_character_is_not_glued_to_output(tokenizer):
    emoji = tokenizer("🎉", add_special_tokens=False).input_ids
    prompt = tokenizer("hi ").input_ids + emoji[:2]  # raw ids, cut mid-character
    ids = emoji[2:] + tokenizer(" done", add_special_tokens=False).input_ids
    pieces = stream_text(tokenizer, prompt, ids, [1] * len(ids))
    assert "".join(pieces) == tokenizer.decode(ids)


def test_work_per_push_does_not_grow_with_the_output(tokenizer):
    decoded_lengths = []

    class CountingTokenizer:
        def decode(self, ids, **kwargs):
            decoded_lengths.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = tokenizer(" ".join(SPLIT_TEXTS) * 5, add_special_tokens=False).input_ids
    assert len(ids) > 400
    pieces = stream_text(CountingTokenizer(), [0, 5, 6], ids, [1] * len(ids))
    assert "".join(pieces) == tokenizer.decode(ids)
    assert max(decoded_lengths) <= 12


def test_sentencepiece_style_leading_space_is_kept(tokenizer):
    # Metaspace tokenizers drop the space of the first decoded token; the prompt context keeps
    # " world" (not "world") as the continuation of "Hello", as vLLM does.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator(["Hello world, hello there world"] * 20, trainer)
    sp = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    prompt = sp("Hello", add_special_tokens=False).input_ids
    out = sp(" world there", add_special_tokens=False).input_ids
    assert sp.decode(out) == "world there"  # alone, the leading space is lost
    assert "".join(stream_text(sp, prompt, out, [1] * len(out))) == " world there"


# ---------------------------------------------------------------- stop strings


def run_stop_checker(stops, chunks, min_tokens=0, tokens_per_chunk=1):
    checker = StopChecker(stops, min_tokens)
    emitted, matched = [], None
    for i, chunk in enumerate(chunks):
        text, matched = checker.check(chunk, (i + 1) * tokens_per_chunk)
        emitted.append(text)
        if matched:
            break
    else:
        emitted.append(checker.flush())
    return emitted, matched


def test_stop_string_in_one_push():
    assert run_stop_checker(["END"], ["abc END xyz"]) == (["abc "], "END")


def test_stop_string_spanning_pushes_is_held_then_cut():
    emitted, matched = run_stop_checker(["END"], ["abc E", "N", "D more"])
    assert emitted == ["abc ", "", ""] and matched == "END"


def test_false_start_is_released():
    emitted, matched = run_stop_checker(["END"], ["x E", "Nx", "y"])
    assert emitted == ["x ", "ENx", "y", ""] and matched is None


def test_held_tail_is_flushed_at_finish():
    emitted, matched = run_stop_checker(["END", "STOP"], ["plain text ST"])
    assert emitted == ["plain text ", "ST"] and matched is None


def test_only_real_prefixes_are_held():
    checker = StopChecker(["</answer>"])
    assert checker.check("no markup here", 1) == ("no markup here", None)
    assert checker.check(" a </an", 2) == (" a ", None)


def test_first_stop_to_end_wins():
    assert run_stop_checker(["abcd", "bc"], ["xabcd"]) == (["xa"], "bc")
    assert run_stop_checker(["abcd", "bc"], ["xab", "cd"]) == (["x", "a"], "bc")
    # Same end: the longer (earlier-starting) one.
    assert run_stop_checker(["cd", "bcd"], ["abcde"]) == (["a"], "bcd")


def test_stop_result_does_not_depend_on_push_boundaries():
    rng = random.Random(3)
    alphabet = "abc d"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(3)]
        whole, whole_match = run_stop_checker(stops, [text])
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, 4)))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        pieces, match = run_stop_checker(stops, chunks)
        assert ("".join(pieces), match) == ("".join(whole), whole_match), (text, stops, chunks)
        # The emitted text never contains a stop string and is a prefix of the input.
        assert text.startswith("".join(pieces))
        assert not any(s in "".join(pieces) for s in stops)


def test_min_tokens_delays_stop_strings():
    # Tokens 1 and 2 are below min_tokens = 3: their "END" passes through.
    emitted, matched = run_stop_checker(["END"], ["END ", "x END", " y END", " z"], min_tokens=3)
    assert emitted == ["END ", "x END", " y "] and matched == "END"


def test_no_stop_strings_pass_everything_through():
    checker = StopChecker([])
    assert checker.check("any text", 1) == ("any text", None)
    assert checker.flush() == ""


def test_after_a_match_nothing_more_is_emitted():
    checker = StopChecker(["."])
    assert checker.check("one. two", 1) == ("one", ".")
    assert checker.check("three", 2) == ("", None)
    assert checker.flush() == ""


# ---------------------------------------------------------------- output text stream


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def test_text_stream_cuts_at_stop_string_across_tokens(tokenizer):
    ids = encode(tokenizer, "The old lighthouse stood at the edge of the harbour")
    stream = OutputTextStream(tokenizer, [0], skip_special_tokens=True, stop=["stood at"])
    out, matched = [], None
    for token in ids:
        text, matched, kept = stream.push([token])
        out.append(text)
        if matched:
            break
    assert "".join(out) == "The old lighthouse " and matched == "stood at" and kept == 1
    assert stream.stopped and stream.push(ids[:2]) == ("", None, 0)


def test_text_stream_keeps_the_tokens_up_to_the_stop_string(tokenizer):
    # Several tokens in one push (speculation, or steps merged while the gateway was busy): the
    # output keeps exactly the tokens a token-by-token stream would have kept.
    ids = encode(tokenizer, "The old lighthouse stood at the edge of the harbour")
    one_by_one = OutputTextStream(tokenizer, [0], skip_special_tokens=True, stop=["stood at"])
    kept_single = next(i + 1 for i, t in enumerate(ids) if one_by_one.push([t])[1])
    stream = OutputTextStream(tokenizer, [0], skip_special_tokens=True, stop=["stood at"])
    text, matched, kept = stream.push(ids)
    assert (text, matched, kept) == ("The old lighthouse ", "stood at", kept_single)
    assert kept < len(ids)


def test_text_stream_min_tokens_split_inside_one_push(tokenizer):
    # Speculative steps deliver several tokens at once; min_tokens still counts tokens.
    ids = encode(tokenizer, " the cat and the dog and the bird")
    and_positions = [i for i, t in enumerate(ids) if tokenizer.decode([t]) == " and"]
    assert len(and_positions) == 2
    min_tokens = and_positions[0] + 2  # the first " and" is token number min_tokens - 1
    results = []
    for chunks in ([len(ids)], [1] * len(ids), [3] * (len(ids) // 3) + [len(ids) % 3]):
        stream = OutputTextStream(tokenizer, [0], skip_special_tokens=True, stop=[" and"], min_tokens=min_tokens)
        pieces, pos = [], 0
        for size in chunks:
            text, matched, _ = stream.push(ids[pos : pos + size], finished=pos + size == len(ids))
            pieces.append(text)
            pos += size
            if matched:
                break
        results.append(("".join(pieces), matched))
    assert results == [(" the cat and the dog", " and")] * 3


def test_text_stream_keeps_stop_token_out_of_text(tokenizer):
    ids = encode(tokenizer, " harbour") + [tokenizer.eos_token_id]
    stream = OutputTextStream(tokenizer, [0], skip_special_tokens=False)
    assert stream.push(ids, finished=True, ends_with_stop_token=True) == (" harbour", None, len(ids))
    assert stream.num_tokens == len(ids)


def test_text_stream_flushes_held_text_at_finish(tokenizer):
    ids = encode(tokenizer, "bread and wat")
    stream = OutputTextStream(tokenizer, [0], skip_special_tokens=True, stop=["water"])
    first, _, _ = stream.push(ids)
    rest, matched, _ = stream.push([], finished=True)
    assert first + rest == "bread and wat" and matched is None
    assert first != "bread and wat"  # "wat" was held as a possible start of "water"


# ---------------------------------------------------------------- output merging


def child_script(rng):
    """Random updates for one child: (text, token_ids, logprobs, finish_reason, stop_reason oneof)."""
    updates = []
    for _ in range(rng.randint(1, 6)):
        ids = [rng.randrange(100) for _ in range(rng.randint(0, 3))]
        text = "".join(rng.choice("xyz ") for _ in range(rng.randint(0, 4)))
        logprobs = [generate_pb2.TokenLogprob(token_id=t, logprob=-rng.random()) for t in ids]
        updates.append([text, ids, logprobs, "", {}])
    finish = rng.choice([("stop", {"stop_string": "."}), ("length", {}), ("stop", {}), ("stop", {"stop_token_id": 9})])
    if rng.random() < 0.5:
        updates.append(["", [], [], *finish])  # finishes with nothing new
    else:
        updates[-1][3:] = finish
    return updates


def merge_all(kind, schedule, n=3, want_logprobs=True):
    state = RequestOutputState("req", n, kind, want_logprobs, prompt_tokens=7)
    responses = []
    for index, (text, ids, logprobs, finish, stop), cached in schedule:
        response = state.update(index, text, ids, logprobs, finish, stop, cached)
        if response is not None:
            responses.append(response)
    return state, responses


def interleaved_schedule(rng, n=3):
    scripts = {i: child_script(rng) for i in range(n)}
    schedule = []
    while scripts:
        index = rng.choice(sorted(scripts))
        schedule.append((index, scripts[index].pop(0), rng.choice([0, 4, 8])))
        if not scripts[index]:
            del scripts[index]
    return schedule


def as_tuple(output):
    return (
        output.text,
        list(output.token_ids),
        [(lp.token_id, lp.logprob) for lp in output.logprobs],
        output.finish_reason,
        {}
        if output.WhichOneof("stop_reason") is None
        else {output.WhichOneof("stop_reason"): getattr(output, output.WhichOneof("stop_reason"))},
    )


@pytest.mark.parametrize("seed", range(20))
def test_delta_final_and_cumulative_agree(seed):
    schedule = interleaved_schedule(random.Random(seed))
    _, cumulative = merge_all(generate_pb2.CUMULATIVE, schedule)
    _, delta = merge_all(generate_pb2.DELTA, schedule)
    _, final = merge_all(generate_pb2.FINAL_ONLY, schedule)

    assert len(final) == 1 and final[0].finished
    final_outputs = [as_tuple(o) for o in final[0].outputs]
    assert [o.index for o in final[0].outputs] == [0, 1, 2]
    assert [as_tuple(o) for o in cumulative[-1].outputs] == final_outputs

    joined = {i: ["", [], [], "", {}] for i in range(3)}
    for response in delta:
        for output in response.outputs:
            text, ids, lps, finish, stop = as_tuple(output)
            assert not joined[output.index][3], "output continued after finishing"
            joined[output.index][0] += text
            joined[output.index][1] += ids
            joined[output.index][2] += lps
            joined[output.index][3:] = [finish, stop]
    assert [tuple(joined[i]) for i in range(3)] == [tuple(o) for o in final_outputs]

    for responses in (cumulative, delta):
        assert [r.finished for r in responses] == [False] * (len(responses) - 1) + [True]
        assert all(r.request_id == "req" for r in responses)
    for response in cumulative:
        assert [o.index for o in response.outputs] == [0, 1, 2]
    expected_usage = generate_pb2.Usage(
        prompt_tokens=7,
        completion_tokens=sum(len(o[1]) for o in final_outputs),
        cached_prompt_tokens=max(c for _, _, c in schedule),
    )
    assert final[0].usage == cumulative[-1].usage == delta[-1].usage == expected_usage


def test_cumulative_texts_only_grow():
    schedule = interleaved_schedule(random.Random(99))
    _, responses = merge_all(generate_pb2.CUMULATIVE, schedule)
    for before, after in zip(responses, responses[1:]):
        for a, b in zip(before.outputs, after.outputs):
            assert b.text.startswith(a.text)
            assert list(b.token_ids[: len(a.token_ids)]) == list(a.token_ids)


def test_delta_sends_only_what_advanced():
    state = RequestOutputState("r", 3, generate_pb2.DELTA, False, prompt_tokens=2)
    response = state.update(1, "hi", [5])
    assert [(o.index, o.text, list(o.token_ids)) for o in response.outputs] == [(1, "hi", [5])]
    # Tokens whose text is still held back (half a character) still advance the output.
    response = state.update(1, "", [6])
    assert [(o.index, o.text, list(o.token_ids)) for o in response.outputs] == [(1, "", [6])]
    assert state.update(2, "", [], cached_prompt_tokens=2) is None  # nothing new
    response = state.update(1, "", [], finish_reason="length")
    assert [(o.index, o.text, o.finish_reason) for o in response.outputs] == [(1, "", "length")]
    assert not response.finished and state.child_finished(1)
    assert response.usage.cached_prompt_tokens == 2


def test_late_updates_after_finish_are_ignored():
    state = RequestOutputState("r", 2, generate_pb2.CUMULATIVE, False, prompt_tokens=1)
    state.update(0, "a", [1], finish_reason="stop", stop={"stop_string": "\n"})
    assert state.update(0, "late", [2]) is None
    assert state.update(0, "", [], finish_reason="length") is None
    assert as_tuple(state.snapshot().outputs[0]) == ("a", [1], [], "stop", {"stop_string": "\n"})


def test_logprobs_only_when_asked():
    lp = [generate_pb2.TokenLogprob(token_id=3, logprob=-0.5)]
    without = RequestOutputState("r", 1, generate_pb2.CUMULATIVE, False, prompt_tokens=1)
    assert len(without.update(0, "a", [3], lp).outputs[0].logprobs) == 0
    with_lp = RequestOutputState("r", 1, generate_pb2.CUMULATIVE, True, prompt_tokens=1)
    assert with_lp.update(0, "a", [3], lp).outputs[0].logprobs[0].logprob == -0.5


def test_final_only_waits_for_every_child():
    state = RequestOutputState("r", 2, generate_pb2.FINAL_ONLY, False, prompt_tokens=1)
    assert state.update(0, "a", [1], finish_reason="length") is None
    assert state.update(1, "b", [2]) is None
    response = state.update(1, "c", [3], finish_reason="stop")
    assert response.finished and [o.text for o in response.outputs] == ["a", "bc"]


def test_children_are_final_only_exactly_when_nothing_needs_streaming():
    def children(**params):
        req = generate_pb2.GenerateRequest(
            prompt_token_ids=generate_pb2.TokenIds(ids=[5, 6]), params=generate_pb2.SamplingParams(n=2, **params)
        )
        validated = validate_request(req, [5, 6], vocab_size=100, max_model_len=64)
        return child_requests("r", validated, [5, 6])

    assert all(c.final_only for c in children(output_kind=generate_pb2.FINAL_ONLY))
    assert not any(c.final_only for c in children(output_kind=generate_pb2.FINAL_ONLY, stop=["x"]))
    assert not any(c.final_only for c in children(output_kind=generate_pb2.DELTA))
    assert not any(c.final_only for c in children())


def test_top_level_field_size_reads_the_prompt_length_from_the_wire_format():
    from strata.services.gateway.validation import top_level_field_size
    from strata.v1 import generate_pb2

    prompt = generate_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["prompt"].number
    msg = generate_pb2.GenerateRequest(
        request_id="r", prompt="é" * 300, params=generate_pb2.SamplingParams(max_tokens=5, stop=["x"], seed=2**63)
    )
    raw = msg.SerializeToString()
    assert top_level_field_size(raw, prompt) == 600  # bytes, not characters
    assert top_level_field_size(raw[:8], prompt) == 600  # a truncated message still tells its claim
    ids = generate_pb2.GenerateRequest(prompt_token_ids=generate_pb2.TokenIds(ids=[1, 2, 3])).SerializeToString()
    assert top_level_field_size(ids, prompt) == 0
    twice = generate_pb2.GenerateRequest(prompt="ab").SerializeToString() + raw  # the last occurrence wins
    assert top_level_field_size(twice, prompt) == 600


# ---------------------------------------------------------------- tool calls, streamed


@pytest.mark.parametrize("seed", range(20))
def test_a_required_tool_call_array_streams_each_call_as_it_is_generated(seed):
    """ "required" tool calls stream incrementally: a call opens (id, name) once its name is
    complete, then its parameters' text arrives as arguments, whatever the text's pieces, the
    key order, the whitespace, or brackets and quotes inside strings."""
    import json
    import random

    from strata.services.gateway.tools import RequiredCallScanner

    calls = [
        {"name": "get_tide", "parameters": {"port": 'St. Ives, "Cornwall"}', "days": [1, 2, {"x": "]"}]}},
        {"parameters": {"bell": 3}, "name": "sonn\u00e9"},  # parameters first: they wait for the name
        {"name": "noop", "parameters": {}},
    ]
    text = json.dumps(calls, indent=seed % 3 or None)
    rng, scanner, deltas, i = random.Random(seed), RequiredCallScanner(), [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        deltas += scanner.feed(text[i : i + n])
        i += n
    got: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:  # the opening delta comes first, once
            assert d["index"] not in got and d["type"] == "function"
            got[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
        got[d["index"]]["arguments"] += d["function"]["arguments"]
    assert [got[k]["name"] for k in range(3)] == ["get_tide", "sonn\u00e9", "noop"]
    assert [json.loads(got[k]["arguments"]) for k in range(3)] == [c["parameters"] for c in calls]
    first_args = next(k for k, d in enumerate(deltas) if d["index"] == 0 and "id" not in d)
    assert first_args < len(deltas) - 1  # streamed before the array was complete
