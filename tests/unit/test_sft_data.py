"""Supervised data (issue 31): chat-template rendering with exact target masks (a Qwen3-style template with
``enable_thinking``, written here), preprocessing into token + target datasets that megatron-core reads,
padded samples with the prompt as context, and one-line errors naming file:line."""
import json

import numpy as np
import pytest
import torch

# Qwen3's behaviour: <|im_start|> / <|im_end|> turns, an empty think block in the generation prompt when
# enable_thinking is false, and on the assistant turns after the last user message only (earlier turns lose it)
QWEN3_STYLE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
NO_GENERATION_PROMPT = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    from setdiff_mega.data.prepare import prepare
    from setdiff_mega.data.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("sfttok")
    prepare(out, None, num_math=40, num_stories=40, vocab_size=300, heldout=2, log=lambda *a: None)
    tok = Tokenizer.from_file(out / "tokenizer.json")
    tok.chat_template = QWEN3_STYLE
    tok.save(out / "chat" / "tokenizer.json")
    return out / "chat" / "tokenizer.json"


def _where():
    return "chats.jsonl:7"


def _renderer(tok_path, **kw):
    from setdiff_mega.data.chat import ChatRenderer
    from setdiff_mega.data.tokenizer import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    return tok, ChatRenderer(tok, kw.pop("template", tok.chat_template), **kw)


@pytest.mark.parametrize("thinking,target", [(False, "4 apples<|im_end|>\n"),
                                             (True, "<think>\n\n</think>\n\n4 apples<|im_end|>\n")])
def test_the_target_is_the_response_as_the_template_renders_it(tok_path, thinking, target):
    tok, r = _renderer(tok_path, template_kwargs={"enable_thinking": thinking})
    ids, mask = r.encode({"prompt": "Ava has 2 apples and buys 2 more. How many?", "response": "4 apples"}, _where)
    assert ids[0] == tok.bos and mask[0] == 0 and ids[-1] == tok.eos and mask[-1] == 1
    assert tok.decode(ids[1:-1][mask[1:-1] == 0]).endswith("<|im_start|>assistant\n" +
                                                         ("" if thinking else "<think>\n\n</think>\n\n"))
    assert tok.decode(ids[:-1][mask[:-1] == 1]) == target
    assert mask[:-1].tolist() == sorted(mask[:-1].tolist())          # context, then the response


def test_every_assistant_turn_or_the_last(tok_path):
    msgs = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 plus 2?"},
                         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3 plus 3?"},
                         {"role": "assistant", "content": "6"}]}
    tok, r = _renderer(tok_path, template=QWEN3_STYLE.replace("loop.index0 > ns.last_user", "true"))
    ids, mask = r.encode(msgs, _where)                    # a template that keeps every turn: both turns
    spans = np.flatnonzero(np.diff(np.r_[0, mask[:-1], 0]))
    assert len(spans) == 4
    assert [tok.decode(ids[a:b]) for a, b in zip(spans[::2], spans[1::2])] == \
        ["<think>\n\n</think>\n\n4<|im_end|>\n", "<think>\n\n</think>\n\n6<|im_end|>\n"]
    _, qwen = _renderer(tok_path)                         # Qwen3 drops earlier turns' think blocks: not a prefix
    from setdiff_mega.data.indexed import DataError

    with pytest.raises(DataError, match=r"chats.jsonl:7: the chat template's rendering of assistant turn 4 does "
                                        r"not extend .*--loss-on last"):
        qwen.encode(msgs, _where)
    _, last = _renderer(tok_path, loss_on="last")
    ids, mask = last.encode(msgs, _where)
    assert tok.decode(ids[:-1][mask[:-1] == 1]) == "<think>\n\n</think>\n\n6<|im_end|>\n"


@pytest.mark.parametrize("record,message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "the conversation has no assistant turn, so nothing to"),
    ({"prompt": "hi", "response": "  "}, "assistant message 1 is empty: fill in the response"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"},
                   {"role": "assistant", "content": "ok"}]}, "message 1 has the unknown role 'tool'"),
    ({"text": "hi"}, "a supervised record has 'messages', or 'prompt' and 'response' \\(keys: text\\)"),
])
def test_bad_records_are_one_line_with_the_place(tok_path, record, message):
    from setdiff_mega.data.indexed import DataError

    _, r = _renderer(tok_path)
    with pytest.raises(DataError, match=r"^chats.jsonl:7: " + message):
        r.encode(record, _where)


def test_a_template_without_generation_prompt_is_refused(tok_path):
    from setdiff_mega.data.indexed import DataError

    _, r = _renderer(tok_path, template=NO_GENERATION_PROMPT)
    with pytest.raises(DataError, match=r"renders no generation prompt"):
        r.encode({"prompt": "hi", "response": "ok"}, _where)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


RECORDS = [{"prompt": f"Q{i}: what is {i} plus {i}?", "response": f"It is {2 * i}."} for i in range(40)]


def test_preprocess_writes_tokens_and_targets_that_megatron_reads(tok_path, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from setdiff_mega.data.chat import ChatRenderer
    from setdiff_mega.data.indexed import read_manifest
    from setdiff_mega.data.sft import preprocess_sft
    from setdiff_mega.data.tokenizer import Tokenizer

    src = _write(tmp_path / "chats.jsonl", RECORDS)
    out = tmp_path / "sft" / "corpus"
    man = preprocess_sft([str(src)], str(out), str(tok_path), template_kwargs={"enable_thinking": False},
                         workers=2, unit_bytes=600, progress=False, log=lambda *a: None)
    assert man["kind"] == "sft" and man["num_documents"] == 40 and man["chat_template"]["kwargs"] == \
        {"enable_thinking": False}
    tokens, targets = IndexedDataset(str(out)), IndexedDataset(f"{out}.target")
    tok = Tokenizer.from_file(tok_path)
    r = ChatRenderer(tok, QWEN3_STYLE, {"enable_thinking": False})
    for i in (0, 17, 39):                                    # input order, whatever the workers
        ids, mask = r.encode(RECORDS[i], _where)
        assert np.array_equal(tokens[i], ids) and np.array_equal(targets[i], mask)
    assert read_manifest(out)["num_target_tokens"] == sum(int(targets[i].sum()) for i in range(40))


def test_a_bad_record_names_its_line_and_leaves_no_dataset(tok_path, tmp_path):
    from setdiff_mega.data.indexed import DataError
    from setdiff_mega.data.sft import preprocess_sft

    bad = RECORDS[:25] + [{"prompt": "x", "response": ""}] + RECORDS[25:]
    src = _write(tmp_path / "chats.jsonl", bad)
    out = tmp_path / "sft" / "corpus"
    with pytest.raises(DataError, match=r"chats.jsonl:26: assistant message 1 is empty"):
        preprocess_sft([str(src)], str(out), str(tok_path), workers=2, unit_bytes=600, progress=False)
    assert not list((tmp_path / "sft").glob("corpus*"))


def test_padded_samples_carry_the_prompt_as_context(tok_path, tmp_path):
    from setdiff_mega.data.batch import batches
    from setdiff_mega.data.sft import preprocess_sft
    from setdiff_mega.data.supervised import build_sft_splits
    from setdiff_mega.data.tokenizer import Tokenizer

    src = _write(tmp_path / "chats.jsonl", RECORDS)
    out = tmp_path / "sft" / "corpus"
    preprocess_sft([str(src)], str(out), str(tok_path), workers=1, progress=False, log=lambda *a: None)
    tok = Tokenizer.from_file(tok_path)
    train, valid, test = build_sft_splits(str(out), tok, 256, "80,20,0", 1, log=lambda *a: None)
    assert (len(train), len(valid), test) == (32, 8, None)
    b = next(batches(train, 4))
    assert b.context.shape == b.padding.shape == (4, 256)
    for row in range(4):
        n = int((~b.padding[row]).sum())
        assert (b.tokens[row, n:] == tok.pad).all() and not b.context[row, n:].any()
        text = tok.decode(b.tokens[row][~b.context[row] & ~b.padding[row]].tolist())
        assert text.startswith("<think>") and text.endswith("<|im_end|>\n" + tok.token(tok.eos))
    notes = []
    with pytest.raises(Exception, match=r"conversation \d+ of .* has \d+ tokens, more than data.seq_length=16"):
        build_sft_splits(str(out), tok, 16, "80,20,0", 1, overlong="error")
    train, _, _ = build_sft_splits(str(out), tok, 16, "80,20,0", 1, overlong="drop", needed=(), log=notes.append)
    assert train is None and "40 of 40 conversations" in notes[0]


def test_an_existing_dataset_is_replaced_only_with_overwrite(tok_path, tmp_path):
    from setdiff_mega.data.sft import preprocess_sft
    from setdiff_mega.outputs import OutputError

    src = _write(tmp_path / "chats.jsonl", RECORDS[:5])
    out = tmp_path / "sft" / "corpus"
    run = lambda **kw: preprocess_sft([str(src)], str(out), str(tok_path), workers=1, progress=False,  # noqa: E731
                                      log=lambda *a: None, **kw)
    run()
    with pytest.raises(OutputError, match="already holds a dataset .*--overwrite"):
        run()
    assert run(overwrite=True)["num_documents"] == 5
    other = tmp_path / "other" / "corpus"                     # a target pair this project did not write
    other.parent.mkdir()
    (tmp_path / "other" / "corpus.target.bin").write_bytes(b"x")
    with pytest.raises(OutputError, match=r"corpus.target.bin' exists and was not written by .* never replaced"):
        preprocess_sft([str(src)], str(other), str(tok_path), workers=1, progress=False, overwrite=True)
    assert (tmp_path / "other" / "corpus.target.bin").read_bytes() == b"x"


@pytest.mark.parametrize("thinking", [False, True])
def test_a_chat_request_is_the_training_prompt(tok_path, thinking):
    """Generation renders a prompt exactly as the supervised data's context before the response."""
    from setdiff_mega.inference.api import encode_request

    tok, r = _renderer(tok_path, template_kwargs={"enable_thinking": thinking})
    ids, mask = r.encode({"prompt": "What is 2 plus 2?", "response": "4"}, _where)
    context = ids[: int(np.argmax(mask))].tolist()
    assert r.prompt_ids("What is 2 plus 2?") == context
    assert encode_request(tok, {"messages": [{"role": "user", "content": "What is 2 plus 2?"}]}, chat=r) == context
    assert encode_request(tok, "What is 2 plus 2?") != context                 # without chat: the plain prompt
    assert encode_request(tok, {"input_ids": context}) == context                # token ids pass as given


def test_chat_prompts_of_a_checkpoint_and_their_errors(tok_path):
    from setdiff_mega.data.chat import ChatRenderer
    from setdiff_mega.data.indexed import DataError
    from setdiff_mega.data.tokenizer import Tokenizer
    from setdiff_mega.inference import RequestError, encode_request

    tok = Tokenizer.from_file(tok_path)
    r = ChatRenderer.of(tok, '{"enable_thinking": false}')
    text = r.render_prompt("What is 2 plus 2?")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and "What is 2 plus 2?" in text
    assert r.context_ids(text) == r.prompt_ids("What is 2 plus 2?") == [tok.bos] + tok.encode(text)
    for kwargs, message in [("{bad", r"are not JSON"), ("[1]", r"must be a JSON object")]:
        with pytest.raises(DataError, match=message):
            ChatRenderer.of(tok, kwargs)
    tok.chat_template = None
    with pytest.raises(DataError, match=r"has no chat template .*send plain prompts"):
        ChatRenderer.of(tok)
    with pytest.raises(RequestError, match=r"input_ids must be a non-empty list of token ids"):
        encode_request(tok, {"input_ids": [tok.vocab_size]})


def test_answers_are_read_from_the_last_box_then_the_hashes():
    from setdiff_mega.eval.tasks import extract_answer, last_boxed

    assert extract_answer("so $\\boxed{12}$ wait, no: $\\boxed{1,234}$.") == "1234"
    assert last_boxed("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert extract_answer("Answer: 3 + 4 = 7\n#### 7") == "7" and extract_answer("it is 5 then 6") == "6"
    assert extract_answer("\\boxed{no number}") is None and extract_answer("\\boxed{3") == "3"


def test_supervised_datasets_are_not_merged_or_blended(tok_path, tmp_path):
    from setdiff_mega.data.indexed import DataError
    from setdiff_mega.data.preprocess import merge
    from setdiff_mega.data.sft import preprocess_sft
    from setdiff_mega.data.supervised import build_sft_splits
    from setdiff_mega.data.tokenizer import Tokenizer

    src = _write(tmp_path / "chats.jsonl", RECORDS[:5])
    out = tmp_path / "sft" / "corpus"
    preprocess_sft([str(src)], str(out), str(tok_path), workers=1, progress=False, log=lambda *a: None)
    with pytest.raises(DataError, match=r"is supervised data .*--merge does not join; preprocess all the inputs"):
        merge([str(out), str(out)], str(tmp_path / "m" / "all"), log=lambda *a: None)
    with pytest.raises(DataError, match=r"supervised data is read from one dataset \(no blends\)"):
        build_sft_splits(f"0.5 {out} 0.5 {out}", Tokenizer.from_file(tok_path), 256, "1,0,0", 1)


def test_first_fit_decreasing_places_each_length_in_the_first_bin_with_room():
    from setdiff_mega.data.packing import first_fit_decreasing

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, size=500)
    bins = first_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(500))               # every one, once
    loads = [int(lengths[b].sum()) for b in bins]
    assert max(loads) <= 64 and len(bins) <= 11 / 9 * (lengths.sum() / 64) + 1 + 1
    # replay: each length, longest first, went to the first bin that had room at that moment
    room, where = [], {i: k for k, b in enumerate(bins) for i in b}
    for i in np.argsort(-lengths, kind="stable"):
        first = next((k for k, r in enumerate(room) if r >= lengths[i]), len(room))
        assert where[i] == first
        if first == len(room):
            room.append(64)
        room[first] -= lengths[i]
    assert first_fit_decreasing([5, 3, 5, 2], 8) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 8\]"):
        first_fit_decreasing([9], 8)


def test_packed_samples_hold_the_padded_conversations_with_their_sample_ids(tok_path, tmp_path):
    from setdiff_mega.data.batch import batches
    from setdiff_mega.data.sft import preprocess_sft
    from setdiff_mega.data.supervised import build_sft_splits
    from setdiff_mega.data.tokenizer import Tokenizer
    from setdiff_mega.diffusion.packing import document_runs

    src = _write(tmp_path / "chats.jsonl", RECORDS)
    out = tmp_path / "sft" / "corpus"
    preprocess_sft([str(src)], str(out), str(tok_path), workers=1, progress=False, log=lambda *a: None)
    tok = Tokenizer.from_file(tok_path)
    padded = build_sft_splits(str(out), tok, 256, "80,20,0", 1, log=lambda *a: None)[0]
    notes = []
    packed = build_sft_splits(str(out), tok, 256, "80,20,0", 1, log=notes.append, packing=True)[0]
    assert len(packed) <= len(padded) / 2 and "32 train conversations in 16 samples" in notes[-1]
    assert sum(packed.documents(i) for i in range(len(packed))) == len(padded) == 32
    assert 0.7 < packed.fill() <= 1.0
    seen = []
    b = next(batches(packed, len(packed)))
    for row in range(b.rows):
        runs = document_runs(b.document_ids[row])
        assert len(runs) == packed.documents(row)
        for j, s, e in runs:                         # conversation j of the packed row is padded sample j
            ref = padded[j]
            n = int((~ref["padding"]).sum())
            assert e - s == n and (b.tokens[row, s:e] == torch.as_tensor(ref["tokens"][:n])).all()
            assert (b.context[row, s:e] == torch.as_tensor(ref["context"][:n])).all()
            seen.append(j)
        end = runs[-1][2]
        assert b.padding[row, end:].all() and not b.padding[row, :end].any() and (b.tokens[row, end:] == tok.pad).all()
    assert sorted(seen) == list(range(32))
