"""Self-speculative decoding (issue 59, setdiff_mega/decoding/speculative.py, method.md 16): greedy speculative
output equals the same checkpoint's AR mode (SetDLM at W = 1 with the head shift), token for token, on every prompt
of the golden set (plain, infill, past the context), alone and batched, cached and uncached, with EOS and the
stopping criteria, through a continuous batch, the plain engine and the export's ``generate``; a scripted model
shows drafts accepted and rejected where they must be; a checkpoint without the head shift or the next-token loss
and the options it cannot honour are refused with one line."""
import pytest
import torch

from setdiff_mega.decoding.base import Canvas, GenerationConfig
from setdiff_mega.decoding.calls import drive
from setdiff_mega.decoding.trace import traces
from setdiff_mega.inference import ARSampler, SetDLMSampler

from .mock import ScriptedModel, Shifted, peaked
from .test_golden_tokens import PROMPTS as GOLDEN
from .test_serving_batching import EOS, MASK, PAD, PROMPTS, Tok, _serve


class Spec(Shifted):
    """A model trained with the head shift and the next-token loss (the attributes a load sets)."""

    self_speculative = True


def _run(model, prompts, **kw):
    kw.setdefault("max_new_tokens", 14)
    kw.setdefault("stop_at_eos", False)
    cfg = GenerationConfig(**kw)
    sampler = SetDLMSampler(model, MASK, PAD, EOS, cfg, tokenizer=Tok())
    return sampler.generate(Canvas.from_prompts(prompts, MASK, PAD, cfg.max_new_tokens))


def _ar(model, prompts, **kw):
    """AR mode: one token per step, the leftmost masked position reading its predecessor's clean row."""
    return _run(model, prompts, window=1, tau=2.0, **kw)


@torch.no_grad()
@pytest.mark.parametrize("window", [2, 4, 7])
@pytest.mark.parametrize("use_cache", [True, False])
def test_speculative_greedy_equals_ar_mode_on_the_golden_prompts(rand_model, window, use_cache):
    model = Spec(rand_model)
    want = _ar(model, GOLDEN).tokens
    got = _run(model, GOLDEN, window=window, speculative=True, use_cache=use_cache)
    assert got.tokens == want
    assert [_run(model, [p], window=window, speculative=True).tokens[0] for p in GOLDEN] == want
    assert got.nfe <= _ar(model, GOLDEN).nfe
    spec = got.speculation
    assert len(spec["verified"]) == window and spec["verified"][0] == 0
    assert all(0 <= a <= v for a, v in zip(spec["accepted"], spec["verified"]))


@torch.no_grad()
@pytest.mark.parametrize("context", [13, 16, 20])
def test_past_the_context_budget_the_tokens_stay_ar_modes(rand_model, context):
    """Near the budget a row's chunk shrinks (queries, then drafts) so nothing is evicted before AR mode evicts;
    then AR mode's own chunk evicts as AR mode does."""
    model = Spec(rand_model)
    want = _ar(model, GOLDEN[:3], context_length=context, max_new_tokens=24)
    for use_cache in (True, False):
        got = _run(model, GOLDEN[:3], window=4, speculative=True, context_length=context, max_new_tokens=24,
                   use_cache=use_cache)
        assert got.tokens == want.tokens and got.evicted == want.evicted > 0


@torch.no_grad()
@pytest.mark.parametrize("stops", [{"stop_at_eos": True}, {"stop_at_eos": True, "min_new_tokens": 5},
                                   {"stop_repeat": 2}, {"stop_confidence": 0.6, "stop_patience": 2},
                                   {"stop_entropy": 1.2, "stop_entropy_window": 4},
                                   {"stop_strings": ("C",)}, {"stop_regex": "[A-Z]{2}C", "stop_regex_count": 1}])
def test_eos_and_every_stopping_criterion_end_where_ar_mode_ends(rand_model, stops):
    model = Spec(rand_model)
    prompts = [p for p in PROMPTS if MASK not in p]
    want = _ar(model, prompts, max_new_tokens=20, **stops)
    got = _run(model, prompts, window=4, speculative=True, max_new_tokens=20, **stops)
    assert got.tokens == want.tokens
    assert [_run(model, [p], window=4, speculative=True, max_new_tokens=20, **stops).tokens[0]
            for p in prompts] == want.tokens


@torch.no_grad()
def test_a_scripted_model_accepts_and_rejects_the_drafts_it_must():
    """ScriptedModel: every row at position p gives table[p]. AR mode writes x_p = argmax table[p - 1] (the clean
    row of p - 1); a draft at p is argmax table[p] (its own MASK row). With table[p] = token 7 except table[9] =
    token 3, every draft is accepted (W tokens per forward) except the draft at p = 9 (3, where AR mode writes 7:
    the correction) and a draft at p = 10 (7, where AR mode writes 3)."""
    V = 61
    rows = [[(7, 5.0)]] * 30
    rows[9] = [(3, 5.0)]
    model = Spec(ScriptedModel(peaked(rows, V)))
    prompt = [[1, 2, 4]]                                           # positions 0..2; generation from 3
    want = _ar(model, prompt, max_new_tokens=14)
    assert want.tokens[0] == [7] * 7 + [3] + [7] * 6              # x_10 = argmax table[9]
    got = _run(model, prompt, window=4, speculative=True, max_new_tokens=14, record=True)
    assert got.tokens == want.tokens
    # forward 1: prefill; then each forward commits the exact token + its accepted drafts
    drafts = got.speculation["drafts"][0]
    first_bad = [d for d in drafts if d["rejected"] is not None]
    assert first_bad and first_bad[0]["rejected"] == 9 and first_bad[0]["correction"] == 7
    # one query group per accepted prefix: the forward after a rejection verifies the kept group's drafts
    assert [d["step"] for d in drafts] == list(range(1, len(drafts) + 1))
    after = drafts[drafts.index(first_bad[0]) + 1]
    assert after["positions"] == [10, 11, 12] and after["tokens"] == [7, 7, 7]      # drafted after d_8 = 7 only
    assert got.nfe < want.nfe and max(got.history[i][0] for i in range(len(got.history))) == 4
    t = traces("setdlm", Canvas.from_prompts(prompt, MASK, PAD, 14), got, GenerationConfig(window=4))[0]
    assert t.drafts == drafts and t.replay()[-1] == t.tokens


@torch.no_grad()
def test_sampled_speculation_is_distributed_as_ar_modes_samples():
    """The rejection rule makes the committed tokens AR mode's samples. On a scripted model (logits independent of the
    context) AR mode samples position p from softmax(table[p - 1] / T) independently; 400 speculative decodes (drafts
    from table[p], a different distribution) must match those marginals at every position (4.5 sigma), while
    committing more than one token per forward (n rows of one batch, each its own stream)."""
    V, n, T = 61, 400, 0.8
    g = torch.Generator().manual_seed(0)
    table = torch.full((16, V), -30.0)
    table[:, 1:5] = torch.randn(16, 4, generator=g) * 1.5
    model = Spec(ScriptedModel(table))
    cfg = GenerationConfig(window=4, speculative=True, max_new_tokens=8, temperature=T, stop_at_eos=False)
    session = SetDLMSampler(model, MASK, PAD, EOS, cfg).session(Canvas.from_prompts([[1, 2, 4]] * n, MASK, PAD, 8))
    for b, gen in enumerate(session.st.generators):                # n independent streams in one decode
        gen.manual_seed(b)
    drive(model, session)
    out = session.output()
    counts = torch.zeros(8, V)
    for toks in out.tokens:
        counts[torch.arange(8), torch.tensor(toks)] += 1
    logits = (table[2:10] / T).index_fill(-1, torch.tensor([MASK]), float("-inf"))    # x_p reads table[p - 1]
    p = torch.softmax(logits, -1)
    assert (counts - n * p).abs().le(4.5 * (n * p * (1 - p)).sqrt() + 1e-6).all()
    per_forward = out.tokens_per_step
    assert sum(per_forward) / n > 1.2


def test_each_query_group_sees_the_exact_token_and_the_drafts_of_its_prefix():
    """The grouped chunk (method.md 16) of a row with e at 3 and drafts at 4, 5, 6 (W = 4, positions 4..12 masked):
    group j starts at the live position of index j; its first column only in the last group (the bonus, read from
    d_3's clean row); group j sees e and d_1..d_j."""
    cfg = GenerationConfig(window=4, speculative=True, max_new_tokens=10, stop_at_eos=False)
    session = SetDLMSampler(Spec(ScriptedModel(torch.zeros(16, 61))), MASK, PAD, EOS, cfg).session(
        Canvas.from_prompts([[1, 2, 4]], MASK, PAD, 10))
    pend_idx = torch.tensor([[3, 4, 5, 6]])
    is_draft = torch.tensor([[False, True, True, True]])
    live = torch.zeros(1, 13, dtype=torch.bool)
    live[0, 4:] = True
    q_idx, q_ok, group, bonus, visible = session._groups(pend_idx, torch.ones_like(is_draft), is_draft, live)
    cols = [[int(q) for q, o, g in zip(q_idx[0], q_ok[0], group[0]) if o and g == j] for j in range(4)]
    assert cols == [[5, 6, 7], [6, 7, 8], [7, 8, 9], [7, 8, 9, 10]]
    assert q_idx[0][bonus[0]].tolist() == [7]
    seen = [visible[0][q_ok[0] & (group[0] == j)] for j in range(4)]
    assert [v.tolist() == [[True] * (j + 1) + [False] * (3 - j)] * len(v) for j, v in enumerate(seen)] == [True] * 4


def _forward(model, runner, *args, **kw):
    """One ``runner.run`` forward driven by hand: its logits."""
    from setdiff_mega.decoding.calls import forward

    gen = runner.run(*args, **kw)
    try:
        gen.send(forward(model, next(gen)))
    except StopIteration as stop:
        return stop.value


@torch.no_grad()
def test_the_query_to_pending_mask_is_what_each_query_attends(rand_model):
    """ChunkRunner's ``query_pending``: queries that see only e (of pending e, d_1) get the logits of the same
    queries in a chunk without d_1; a static chunk (padded widths) gives the unpadded chunk's logits."""
    from setdiff_mega.decoding.runner import ChunkRunner

    tokens = torch.tensor([[1, 5, 9, 14, 22, MASK, MASK, MASK]])

    def queries(pend, query_pending=None, static=None):
        runner = ChunkRunner(rand_model, tokens, MASK, PAD, True, None, static_chunk=static)
        pre = torch.arange(3)[None]
        _forward(rand_model, runner, pre, pre >= 0, pre[:, :0], pre[:, :0] >= 0)          # the prompt's prefill
        runner.persist()
        p_idx, q_idx = torch.tensor([pend]), torch.tensor([[5, 6]])
        return _forward(rand_model, runner, p_idx, p_idx >= 0, q_idx, q_idx >= 0, query_pending=query_pending)

    sees_e = torch.tensor([[[True, False], [True, False]]])
    alone = queries([3])
    assert torch.allclose(queries([3, 4], sees_e), alone, atol=1e-5)
    assert not torch.allclose(queries([3, 4]), alone, atol=1e-3)                  # seeing d_1 changes them
    assert torch.allclose(queries([3, 4], sees_e, static=(4, 4)), alone, atol=1e-5)


@torch.no_grad()
def test_rows_of_a_batch_accept_different_lengths(rand_model):
    rows = [[(7, 5.0)]] * 40
    model = Spec(ScriptedModel(peaked(rows, 61)))
    batch = [[1, 2, 4], [1, 2, 4, 5, 6, 8, 9]]
    rows[12] = [(3, 5.0)]                                           # the second row's drafts cross it earlier
    model = Spec(ScriptedModel(peaked(rows, 61)))
    got = _run(model, batch, window=3, speculative=True, max_new_tokens=10, record=True)
    assert got.tokens == _ar(model, batch, max_new_tokens=10).tokens
    logs = got.speculation["drafts"]                                 # every forward after a row's first has drafts
    assert all([d["step"] for d in log] == list(range(1, len(log) + 1)) for log in logs)
    assert any(d["rejected"] is not None for log in logs for d in log)
    assert len({tuple(h) for h in got.history if h[0] and h[1]} - {(3, 3)}) > 0     # different lengths in a step


@torch.no_grad()
def test_a_continuous_batch_decodes_each_speculative_job_as_ar_mode_alone(rand_model):
    """Jobs join and leave mid-decode (different lengths, staggered arrivals): each decodes AR mode's tokens."""
    model = Spec(rand_model)
    cfgs = [GenerationConfig(max_new_tokens=6 + 3 * (i % 3), stop_at_eos=False, window=4, speculative=True)
            for i in range(len(PROMPTS))]
    jobs, events, sch = _serve(model, "setdlm", cfgs, PROMPTS, max_batch=3, stagger=0.003)
    for i, (p, c) in enumerate(zip(PROMPTS, cfgs)):
        done = [x for ev, x in events[i] if ev == "done"]
        assert done and done[0]["token_ids"] == _ar(model, [p], max_new_tokens=c.max_new_tokens).tokens[0], i


def test_a_checkpoint_without_the_head_shift_or_the_next_token_loss_is_refused(rand_model):
    cfg = GenerationConfig(speculative=True)

    class NoLoss(Spec):
        self_speculative = False
    with pytest.raises(ValueError, match=r"trained with the AR head shift \(model.shift_logits=true\) and the "
                                         r"next-token loss"):
        SetDLMSampler(rand_model, MASK, PAD, EOS, cfg)
    with pytest.raises(ValueError, match=r"with the next-token loss \(objective.ar_weight > 0\)"):
        SetDLMSampler(NoLoss(rand_model), MASK, PAD, EOS, cfg)
    with pytest.raises(ValueError, match="ARSampler has none"):
        ARSampler(Spec(rand_model), MASK, PAD, EOS, cfg)


@pytest.mark.parametrize("option,text", [({"repetition_penalty": 1.2}, "repetition_penalty"),
                                         ({"length_penalty": (4, 1.1)}, "length_penalty"),
                                         ({"fht_cache_order": True}, "fht_cache_order"),
                                         ({"infill_full_context": False}, "prefix-only"),
                                         ({"static_shapes": True}, "static_shapes")])
def test_options_speculation_cannot_honour_are_refused(option, text):
    with pytest.raises(ValueError, match=text):
        GenerationConfig(speculative=True, **option).validate()


def test_the_registry_record_says_which_checkpoints_self_speculate():
    from setdiff_mega import methods
    from setdiff_mega.diffusion.setdlm import SetDLMOptions

    assert SetDLMOptions(ar_weight=1.0).self_speculative and not SetDLMOptions().self_speculative
    assert SetDLMOptions(ar_weight=0.5).export_record()["self_speculative"] is True
    assert not methods.get("ar").make_options().self_speculative


@pytest.fixture(scope="module")
def spec_export(mcore, tmp_path_factory):
    """A random SetDLM checkpoint with the head shift and the next-token loss (L = 24: 40 tokens decode past it),
    loaded natively and exported; and one without the next-token loss."""
    from setdiff_mega.checkpoint import convert, load_model, save_model_checkpoint
    from setdiff_mega.config import load_config
    from setdiff_mega.data.prepare import prepare
    from setdiff_mega.data.tokenizer import Tokenizer
    from setdiff_mega.model import build_model

    d = tmp_path_factory.mktemp("spec")
    prepare(d / "tok", None, num_math=60, num_stories=60, vocab_size=300, heldout=2, log=lambda *a: None)
    tok = Tokenizer.from_file(d / "tok" / "tokenizer.json")
    out = {}
    for name, weight in (("spec", "1.0"), ("plain", "0.0")):
        cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
                                 "model.zero_init_head=false", "model.init_method_std=0.3", "data.seq_length=24",
                                 "objective.name=setdlm", "objective.D=2", "model.shift_logits=true",
                                 f"objective.ar_weight={weight}"])
        torch.manual_seed(0)
        ck = save_model_checkpoint(d / name, 3, build_model(cfg.model, tok.vocab_size), cfg, tok)
        model, objective, _, cfg = load_model(ck)
        out[name] = (model.eval(), objective, cfg, ck)
    out["hf"] = convert.export(out["spec"][3], d / "hf")
    return out, tok


def test_both_engines_and_the_export_decode_ar_modes_tokens(spec_export):
    """The native (megatron-core) model, its plain twin and the export's ``generate``: speculative == AR mode."""
    from transformers import AutoModelForCausalLM

    from setdiff_mega.inference import build_sampler
    from setdiff_mega.inference.engine import plain_model
    from setdiff_mega.inference.options import generation_config

    from .test_export_generate import _batch

    exp, tok = spec_export
    model, objective, cfg, _ = exp["spec"]
    rows = [[tok.bos, *tok.encode("Question: what is 3 plus")], [tok.bos, *tok.encode("Once upon")],
            [tok.bos, *tok.encode("Question: what"), *[tok.mask] * 5, *tok.encode("plus 4?"), tok.eos]]
    base = {"max_new_tokens": 40, "stop_at_eos": False}

    def decode(m, **o):
        gc = generation_config(cfg.objective, cfg.data.seq_length, overrides={**base, **o})
        with torch.no_grad():
            return build_sampler(objective, m, tok, gc).generate(
                Canvas.from_prompts(rows, tok.mask, tok.pad, gc.max_new_tokens)).tokens

    want = decode(model, window=1, tau=2.0)
    assert len(set(want[0])) > 3
    assert decode(model, window=4, speculative=True) == want
    twin = plain_model(model, cfg, tok)
    assert twin.self_speculative and decode(twin, window=4, speculative=True) == want == decode(twin, window=1,
                                                                                                    tau=2.0)
    hf = AutoModelForCausalLM.from_pretrained(str(exp["hf"]), trust_remote_code=True).eval()
    ids, mask = _batch(rows, tok.pad)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, window=4, speculative=True, record=True, **base)
    assert out.generated == want and out.trace[0]["drafts"]
    with pytest.raises(ValueError, match="next-token loss"):
        decode(exp["plain"][0], window=4, speculative=True)


def test_a_server_request_names_the_option_and_is_checked_before_it_queues(spec_export):
    """The server's request body takes ``speculative`` (serving/protocol.py); its job decodes in a session of its
    own key (the continuous-batch test above: AR mode's tokens), and options it cannot honour are a 400."""
    from setdiff_mega.errors import RequestError
    from setdiff_mega.serving.protocol import ServerDefaults, config_of

    exp, _ = spec_export
    cfg = exp["spec"][2]
    d = ServerDefaults(objective=cfg.objective, seq_length=cfg.data.seq_length, base=GenerationConfig(window=4))
    assert config_of({"speculative": True, "temperature": 0}, d).speculative
    with pytest.raises(RequestError, match="repetition_penalty"):
        config_of({"speculative": True, "repetition_penalty": 1.3}, d)


def test_the_bench_reports_acceptance_by_window_position_and_forwards_with_drafts(spec_export, tmp_path):
    """tools/bench_generate.py --speculative-only's report (setdiff_mega/inference/benchmark.py) on the export
    fixture's checkpoint: AR mode's tokens, acceptance lengths, draft acceptance by window position, the fraction of
    forwards that verified drafts, and the PNG."""
    from setdiff_mega.inference import benchmark

    exp, tok = spec_export
    model, objective, _, _ = exp["spec"]
    base = GenerationConfig(max_new_tokens=12, stop_at_eos=False)
    report = benchmark.speculative_comparison(model, tok, objective.name, ["Question: what is 3 plus", "Once upon"],
                                              base, windows=(4,), thresholds=((4, 0.9),), batches=(1, 2), repeats=1)
    row = report["settings"]["speculative_W4"]
    assert row["identical_to_ar_mode"] and row["prompts_equal_to_ar_mode"] == 2
    assert sorted(row["draft_acceptance_by_position"]) == [1, 2, 3]
    forwards = sum(row["acceptance_lengths"].values())                  # (row, forward) pairs that committed
    assert forwards > 0 and row["forwards_with_drafts"] == row["draft_acceptance_by_position"][1]["verified"] / forwards
    assert 0 < row["forwards_with_drafts"] <= 1       # not all: L = 24, drafts are cut near the context budget
    benchmark.plot_acceptance(report, tmp_path / "acceptance.png")
    assert (tmp_path / "acceptance.png").stat().st_size > 0


def test_the_bench_reads_a_task_split_with_chat_prompts(spec_export, tmp_path):
    """``tools/bench_generate.py --tasks`` takes a task split (the conversion study's dev.jsonl): chat records are
    rendered with the checkpoint's chat template as the study's evaluation renders them, plain ones kept as text,
    'question' records in the math prompt format; a record with neither is refused naming its line."""
    import copy
    import json
    import runpy

    from setdiff_mega.data.chat import ChatRenderer

    _, tok = spec_export
    tok = copy.deepcopy(tok)
    tok.chat_template = ("{% for m in messages %}<u>{{ m.content }}</u>{% endfor %}"
                         "{% if add_generation_prompt %}A:{% endif %}")
    path = tmp_path / "dev.jsonl"
    recs = [{"prompt": "What is 1 + 2?", "format": "chat"}, {"prompt": "Once upon"}, {"question": "3 plus 4?"}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    load = runpy.run_path("tools/bench_generate.py", run_name="bench_generate")["load_prompts"]
    got = load(path, 8, tok)
    assert got == [{"input_ids": ChatRenderer.of(tok).prompt_ids("What is 1 + 2?")}, "Once upon",
                   "Question: 3 plus 4?\nAnswer:"]
    assert load(path, 1, tok) == got[:1]
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="dev.jsonl:1: a prompt record needs"):
        load(path, 8, tok)
    path.write_text('{"prompt": "x"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="dev.jsonl:2: not valid JSON"):
        load(path, 8, tok)


def test_the_task_evaluations_score_ar_modes_answers(spec_export, tmp_path):
    """The embedded task evaluations (setdiff_mega/eval/tasks.py: math and arithmetic questions, story infill)
    decoded speculatively produce AR mode's texts, batched as the evaluation batches them. The held-out task files
    are generated here with the fixture's tokenizer (a clean clone has no data/embedded)."""
    from setdiff_mega.data.prepare import prepare
    from setdiff_mega.eval.tasks import load_task, math_accuracy, story_infill
    from setdiff_mega.inference.options import generation_config

    exp, tok = spec_export
    model, objective, cfg, _ = exp["spec"]
    ctx = 160                                          # past the training length: the budget, as evaluate allows

    def gc(**o):
        return generation_config(cfg.objective, ctx, overrides={"max_new_tokens": 12, "stop_at_eos": True, **o})

    ar, spec = gc(window=1, tau=2.0), gc(window=4, speculative=True)
    tok.save(tmp_path / "tokenizer.json")
    prepare(tmp_path / "emb", None, tokenizer_path=str(tmp_path / "tokenizer.json"), num_math=60, num_stories=60,
            heldout=6, log=lambda *a: None)
    tasks = tmp_path / "emb" / "tasks"
    for name in ("math", "arith"):
        rows = load_task(tasks, name, limit=6)
        want = math_accuracy(model, tok, objective, rows, ar, ctx, batch_size=3, keep_texts=True)
        got = math_accuracy(model, tok, objective, rows, spec, ctx, batch_size=3, keep_texts=True)
        assert want["n"] == 6 and got["texts"] == want["texts"] and len(set(want["texts"])) > 1
    ctx = 480                                          # a whole story with this 300-token vocabulary
    rows = load_task(tasks, "stories", limit=3)
    want = story_infill(model, tok, objective, rows, gc(window=1, tau=2.0), ctx, batch_size=3)
    got = story_infill(model, tok, objective, rows, gc(window=4, speculative=True), ctx, batch_size=3)
    assert want["n"] == 3 and got["examples"] == want["examples"]
