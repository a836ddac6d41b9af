"""setdiff-prep, the shard reader and the loader: round trip, determinism, bad input, resume."""

import gzip
import hashlib
import json
import os

import numpy as np
import pytest

from data_prep.prep import PrepError, prepare
from data_prep.prep import main as prep_main
from setdiff_dist.data import sample_text
from setdiff_dist.data.loader import TokenLoader
from setdiff_dist.data.shards import ShardError, ShardSet, read_manifest
from setdiff_dist.data.tokenizers import load_shipped_tokenizer, load_tokenizer

PARAS = [p.strip() for p in sample_text().split("\n\n") if p.strip()]


@pytest.fixture(scope="module")
def sonnets(tmp_path_factory):
    path = tmp_path_factory.mktemp("raw") / "sonnets.txt"
    path.write_text(sample_text(), encoding="utf-8")
    return str(path)


def files_digest(directory):
    return {f: hashlib.sha256(open(os.path.join(directory, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(directory))}


def all_tokens(shards):
    return np.concatenate([shards[i][0][: shards[i][1]] for i in range(len(shards))])


def test_round_trip_bytes_packed(sonnets, tmp_path):
    out = tmp_path / "shards"
    m = prepare([sonnets], "bytes", 64, str(out), split_paragraphs=True, valid_every=0,
                samples_per_shard=10, workers=2, progress=False)
    tok = load_shipped_tokenizer(str(out), m["tokenizer"])
    s = ShardSet(str(out), "train", seq_len=64, tokenizer_sha256=tok.sha256)
    assert len(s) == m["splits"]["train"]["samples"] and len(m["splits"]["train"]["shards"]) > 1
    decoded = tok.decode(all_tokens(s).tolist())
    expected = "".join(p + "\x00" for p in PARAS)  # EOS (256) is dropped by the byte decoder
    assert decoded == expected.replace("\x00", "")[: len(decoded)]
    # every EOS separates documents: split on it and compare documents exactly
    ids = all_tokens(s).tolist()
    docs = bytes(i if i < 256 else 0 for i in ids).decode().split("\x00")
    assert docs[:-1] == PARAS[: len(docs) - 1]
    total = sum(len(p.encode()) + 1 for p in PARAS)
    assert m["splits"]["train"]["dropped_tail_tokens"] == total - len(ids)


def test_round_trip_gpt2_from_gzipped_jsonl(tmp_path):
    src = tmp_path / "docs.jsonl.gz"
    with gzip.open(src, "wt", encoding="utf-8") as fh:
        for p in PARAS:
            fh.write(json.dumps({"body": p}) + "\n")
    out = tmp_path / "shards"
    assert prep_main(["--input", str(src), "--tokenizer", "gpt2", "--seq-len", "32", "--out",
                      str(out), "--text-field", "body", "--valid-every", "2", "--quiet"]) == 0
    m = read_manifest(str(out))
    assert m["tokenizer"]["vocab_size"] == 50257 and m["tokenizer"]["eos_id"] == 50256
    tok = load_tokenizer("gpt2")
    train = tok.decode(all_tokens(ShardSet(str(out), "train")).tolist())
    valid = tok.decode(all_tokens(ShardSet(str(out), "valid")).tolist())
    assert train.split("<|endoftext|>")[:-1] == PARAS[0::2][: train.count("<|endoftext|>")]
    assert valid.split("<|endoftext|>")[0] == PARAS[1][: len(valid.split("<|endoftext|>")[0])]


def test_same_input_gives_byte_identical_shards_whatever_the_workers(sonnets, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    prepare([sonnets], "bytes", 48, str(a), split_paragraphs=True, valid_every=3, workers=1,
            samples_per_shard=7, progress=False)
    prepare([sonnets], "bytes", 48, str(b), split_paragraphs=True, valid_every=3, workers=2,
            samples_per_shard=7, progress=False)
    assert files_digest(a) == files_digest(b)


def test_trained_bpe_and_sentencepiece_tokenizers_ship_with_the_shards(sonnets, tmp_path):
    m = prepare([sonnets], "bpe:300", 32, str(tmp_path / "bpe"), split_paragraphs=True,
                valid_every=0, progress=False)
    tok = load_shipped_tokenizer(str(tmp_path / "bpe"), m["tokenizer"])
    assert m["tokenizer"]["file"] == "tokenizer.json" and tok.vocab_size == 300
    text = tok.decode(all_tokens(ShardSet(str(tmp_path / "bpe"))).tolist())
    assert text.startswith(PARAS[0] + "<|endoftext|>" + PARAS[1][:20])

    import sentencepiece as spm

    spm.SentencePieceTrainer.train(input=sonnets, model_prefix=str(tmp_path / "sp"),
                                   vocab_size=120, minloglevel=2)
    m = prepare([sonnets], f"sentencepiece:{tmp_path / 'sp.model'}", 32, str(tmp_path / "spout"),
                split_paragraphs=True, valid_every=0, progress=False)
    tok = load_shipped_tokenizer(str(tmp_path / "spout"), m["tokenizer"])
    assert m["tokenizer"]["file"] == "tokenizer.model"
    first = all_tokens(ShardSet(str(tmp_path / "spout"))).tolist()
    assert tok.decode(first[: first.index(tok.eos_id)]) == " ".join(PARAS[0].split())


def test_padded_mode_keeps_prompts_as_context(tmp_path):
    src = tmp_path / "task.jsonl"
    rows = [{"q": "Question: 2+2?\nAnswer: ", "a": "4 #### 4"},
            {"q": "Question: 3*3?\nAnswer: ", "a": "9 #### 9"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "padded"
    prepare([str(src)], "bytes", 40, str(out), mode="padded", text_field="a", prompt_field="q",
            valid_every=0, progress=False)
    s = ShardSet(str(out))
    tokens, length, context = s[1]
    assert context == len(rows[1]["q"]) and length == context + len(rows[1]["a"]) + 1
    assert bytes(tokens[:context].tolist()).decode() == rows[1]["q"]
    assert (tokens[length:] == 256).all()
    with pytest.raises(PrepError, match=r"task.jsonl line 1: 32 tokens do not fit --seq-len 24"):
        prepare([str(src)], "bytes", 24, str(tmp_path / "short"), mode="padded",
                text_field="a", prompt_field="q", valid_every=0, progress=False)
    prepare([str(src)], "bytes", 28, str(tmp_path / "cut"), mode="padded", text_field="a",
            prompt_field="q", valid_every=0, truncate=True, progress=False)
    assert ShardSet(str(tmp_path / "cut"))[0][1] == 28


def test_bos_eos_frames_prompts_and_cuts_keep_their_end_of_text(tmp_path):
    """--bos-eos --max-prompt-tokens --max-text-tokens: the reference's CNN/DailyMail rows,
    [BOS] article [EOS] cut to N with its [EOS] kept, then the text and its [EOS] cut to M with
    the [EOS] last; a short record uncut; the byte tokenizer has no BOS: its end-of-text."""
    src = tmp_path / "cnn.jsonl"
    rows = [{"article": "a" * 30, "highlights": "b" * 30}, {"article": "cc", "highlights": "d"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = prepare([str(src)], "bytes", 40, str(tmp_path / "out"), mode="padded",
                prompt_field="{article}", text_field="Summary: {highlights}", bos_eos=True,
                max_prompt_tokens=12, max_text_tokens=16, valid_every=0, progress=False)
    assert m["splits"]["train"]["prompts_cut"] == 1 and m["splits"]["train"]["texts_cut"] == 1
    assert m["options"]["bos_eos"] is True and m["options"]["max_text_tokens"] == 16
    eos = 256
    s = ShardSet(str(tmp_path / "out"))
    tokens, length, context = s[0]
    assert context == 12 and length == 12 + 16
    assert tokens[:context].tolist() == [eos] + list(b"a" * 10) + [eos]
    assert tokens[context:length].tolist() == list(b"Summary: bbbbbb") + [eos]
    tokens, length, context = s[1]
    assert tokens[:length].tolist() == [eos] + list(b"cc") + [eos] + list(b"Summary: d") + [eos]
    with pytest.raises(PrepError, match="--bos-eos"):
        prepare([str(src)], "bytes", 40, str(tmp_path / "packed"), text_field="article",
                bos_eos=True, valid_every=0, progress=False)


@pytest.mark.parametrize("content, message", [
    (b"", "empty file"),
    (b"   \n\n", "empty file"),
    (b"caf\xe9 au lait\n", "not valid UTF-8 (byte 3, line 1)"),
])
def test_bad_text_input_names_the_file_and_leaves_nothing(tmp_path, content, message):
    bad = tmp_path / "in" / "bad.txt"
    bad.parent.mkdir()
    bad.write_bytes(content)
    out = tmp_path / "out"
    with pytest.raises(PrepError) as exc:
        prepare([str(bad)], "bytes", 16, str(out), valid_every=0, progress=False)
    assert str(bad) in str(exc.value) and message in str(exc.value)
    assert sorted(os.listdir(tmp_path)) == ["in"]  # no output, no temporary directory


def test_bad_jsonl_and_cli_exit_code(tmp_path, capsys):
    src = tmp_path / "x.jsonl"
    src.write_text('{"text": "fine"}\n{"txt": "wrong field"}\n')
    assert prep_main(["--input", str(src), "--tokenizer", "bytes", "--seq-len", "8", "--out",
                      str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{src} line 2: no string field 'text'" in err
    src.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(PrepError, match="line 2: not valid JSON"):
        prepare([str(src)], "bytes", 8, str(tmp_path / "o"), progress=False)
    with pytest.raises(PrepError, match="no such file"):
        prepare([str(tmp_path / "missing.txt")], "bytes", 8, str(tmp_path / "o"), progress=False)
    assert not (tmp_path / "o").exists()


def test_an_unterminated_csv_quote_is_an_error_naming_the_line_it_opened_on(tmp_path, capsys):
    """A CSV field whose quote never closes is an error naming the file and the line of that
    quote (exit code 2, nothing written), not the rest of the file silently read as one field;
    records spanning lines (a quoted newline) are named by the line they start on."""
    src = tmp_path / "rows.csv"
    good = 'text,label\n"two\nlines",1\nplain,2\n'
    src.write_text(good + '"never closed,3\nswallowed,4\nswallowed too,5\n')
    out = tmp_path / "o"
    assert prep_main(["--input", str(src), "--tokenizer", "bytes", "--seq-len", "8", "--out",
                      str(out), "--valid-every", "0", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{src} line 5: a quoted field opens here and its quote never closes" in err, err
    assert "close the quote" in err and "Traceback" not in err
    assert not out.exists()
    # closed: a record named by the line it starts on (the third record, on line 5, has no
    # label); read whole, four records
    src.write_text(good + '"closed, no label"\nfine,4\n')
    with pytest.raises(PrepError, match=f"{src} line 5: no string field 'label'"):
        prepare([str(src)], "bytes", 8, str(out), text_field="label", progress=False)
    m = prepare([str(src)], "bytes", 8, str(out), valid_every=0, progress=False)
    assert m["documents"] == 4


def test_existing_output_is_kept_unless_overwrite(sonnets, tmp_path):
    out = tmp_path / "out"
    prepare([sonnets], "bytes", 64, str(out), split_paragraphs=True, valid_every=0,
            progress=False)
    before = files_digest(out)
    with pytest.raises(PrepError, match="already exists; pass --overwrite"):
        prepare([sonnets], "bytes", 32, str(out), split_paragraphs=True, valid_every=0,
                progress=False)
    assert files_digest(out) == before
    prepare([sonnets], "bytes", 32, str(out), split_paragraphs=True, valid_every=0,
            overwrite=True, progress=False)
    assert read_manifest(str(out))["seq_len"] == 32


@pytest.fixture()
def shards(sonnets, tmp_path):
    out = tmp_path / "shards"
    prepare([sonnets], "bytes", 32, str(out), split_paragraphs=True, valid_every=0,
            samples_per_shard=20, progress=False)
    return out


def test_corrupt_or_truncated_shards_and_mismatches_are_named(shards, capsys):
    assert prep_main(["--verify", str(shards)]) == 0
    assert "every size and sha256 as the manifest says" in capsys.readouterr().err
    with pytest.raises(ShardError, match="shards hold sequences of 32 tokens but data.seq_len=64"):
        ShardSet(str(shards), seq_len=64)
    with pytest.raises(ShardError, match="not with the configured tokenizer"):
        ShardSet(str(shards), tokenizer_sha256=load_tokenizer("gpt2").sha256)
    with pytest.raises(ShardError, match="no 'valid' samples"):
        ShardSet(str(shards), "valid")
    tar = shards / "train-00001.tar"
    data = bytearray(tar.read_bytes())
    data[3000] ^= 0xFF
    tar.write_bytes(bytes(data))
    s = ShardSet(str(shards), verify="full")  # (the default checks sizes: prep hashed them)
    s[0]  # shard 0 is fine
    with pytest.raises(ShardError, match=f"shard {tar} is corrupt"):
        s[25]
    assert prep_main(["--verify", str(shards)]) == 2  # the explicit check finds it too
    assert f"shard {tar} is corrupt" in capsys.readouterr().err
    tar.write_bytes(bytes(data[:-700]))
    with pytest.raises(ShardError, match=f"shard {tar} is truncated"):
        ShardSet(str(shards))
    (shards / "manifest.json").unlink()
    with pytest.raises(ShardError, match="manifest.json is missing"):
        ShardSet(str(shards))


def take(loader, steps):
    out = []
    for _, micro in zip(range(steps), loader):
        out.append([(b.tokens.clone(), b.indices.clone()) for b in micro])
    return out


def test_loader_resumes_exactly_and_partitions_ranks(shards):
    s = ShardSet(str(shards))
    n = len(s)
    full = take(TokenLoader(s, global_batch=8, micro_batch=2, seed=3, num_workers=0), 2 * n // 8)
    # resuming at step 3, with two worker processes, continues with the same batches
    resumed = TokenLoader(s, global_batch=8, micro_batch=2, seed=3, num_workers=2)
    resumed.load_state_dict({**resumed.state_dict(), "step": 3})
    again = take(resumed, 4)
    for a, b in zip(full[3:7], again):
        for (ta, ia), (tb, ib) in zip(a, b):
            assert (ta == tb).all() and (ia == ib).all()
    # each epoch visits every sample once
    seen = [int(i) for step in full for _, idx in step for i in idx]
    assert seen[: n] == list(range(n))[: n]  # stream positions
    first_epoch = {tuple(t.tolist()) for step in full for tok, idx in step
                   for t, i in zip(tok, idx) if i < n}
    assert len(first_epoch) == len({tuple(s[i][0].tolist()) for i in range(n)})
    # two data-parallel ranks split each global batch
    ranks = [take(TokenLoader(s, global_batch=8, micro_batch=2, seed=3, dp_rank=r, dp_size=2,
                              num_workers=0), 2) for r in range(2)]
    for step in range(2):
        union = [i for r in range(2) for _, idx in ranks[r][step] for i in idx.tolist()]
        assert union == [i for _, idx in full[step] for i in idx.tolist()]
    with pytest.raises(ShardError, match="checkpoint has seed=4"):
        resumed.load_state_dict({**resumed.state_dict(), "seed": 4})


def test_a_resume_at_another_data_parallel_size_sees_each_sample_once(shards):
    """Steps 1-3 on 2 data-parallel ranks, then resumed at step 3 on 4 ranks (and on 1) until
    the epoch ends: counted over all ranks, each stream position and each sample of the epoch
    is seen exactly once (the global batch is the same; only its split over ranks changes)."""
    from collections import Counter

    s = ShardSet(str(shards))
    n = len(s)
    steps = n // 8  # (whole steps of the first epoch)

    def seen(dp, start, count):
        out = []
        for r in range(dp):
            loader = TokenLoader(s, global_batch=8, micro_batch=2, seed=3, dp_rank=r,
                                 dp_size=dp, num_workers=0)
            loader.load_state_dict({**loader.state_dict(), "step": start})
            out += [(int(i), tuple(t.tolist())) for step in take(loader, count)
                    for tok, idx in step for t, i in zip(tok, idx)]
        return out

    samples = Counter(tuple(s[i][0].tolist()) for i in range(n))
    for after in (4, 1):
        got = seen(2, 0, 3) + seen(after, 3, steps - 3)
        assert sorted(i for i, _ in got) == list(range(steps * 8)), after
        counted = Counter(t for _, t in got)
        assert all(counted[t] <= samples[t] for t in counted), after  # none twice
        assert sum(counted.values()) == steps * 8


GSM8K_ROWS = [  # GSM8K's schema: question, answer (a worked solution ending in #### N)
    {"question": "Tom has 3 apples and buys 4 more. How many?",
     "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A box holds 12 pens; 5 are red. How many are not?",
     "answer": "12 - 5 = <<12-5=7>>7 are not red.\n#### 7"},
    {"question": "Ann reads 2 pages a day for 9 days. Pages?",
     "answer": "2 * 9 = <<2*9=18>>18 pages.\n#### 18"},
]


def test_datasets_in_their_on_disk_formats_give_the_same_shards(tmp_path):
    """The same GSM8K rows as JSONL, CSV, Parquet and a datasets.save_to_disk folder (Arrow),
    prepared with templates of their fields, give identical shards; a template that names a
    missing field, and a DatasetDict folder, are clear errors."""
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq

    datasets = pytest.importorskip("datasets")
    src = tmp_path / "src"
    src.mkdir()
    (src / "gsm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    with open(src / "gsm.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["question", "answer"])
        w.writeheader()
        w.writerows(GSM8K_ROWS)
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), src / "gsm.parquet")
    datasets.Dataset.from_list(GSM8K_ROWS).save_to_disk(str(src / "saved"))
    digests = {}
    for name in ("gsm.jsonl", "gsm.csv", "gsm.parquet", "saved"):
        out = tmp_path / f"out-{name}"
        m = prepare([str(src / name)], "bytes", 128, str(out), mode="padded",
                    prompt_field="Question: {question}\nAnswer: ", text_field="{answer}",
                    valid_every=0, progress=False)
        assert m["documents"] == 3, name
        digests[name] = {f: d for f, d in files_digest(out).items() if f != "manifest.json"}
    assert all(d == digests["gsm.jsonl"] for d in digests.values()), digests
    # the prompt is context, the solution the text: read back from the shards
    tokens, length, context = ShardSet(str(tmp_path / "out-saved"))[0]
    prompt = "Question: " + GSM8K_ROWS[0]["question"] + "\nAnswer: "
    assert bytes(tokens[:context].tolist()).decode() == prompt
    assert bytes(tokens[context:length - 1].tolist()).decode() == GSM8K_ROWS[0]["answer"]
    with pytest.raises(PrepError, match="no field 'solution' for the template"):
        prepare([str(src / "gsm.parquet")], "bytes", 128, str(tmp_path / "x"),
                text_field="{question} {solution}", progress=False)
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K_ROWS)}).save_to_disk(
        str(dd))
    with pytest.raises(PrepError, match="give one split's folder"):
        prepare([str(dd)], "bytes", 128, str(tmp_path / "y"), progress=False)


def test_lm1b_wordpiece_with_a_bos_per_chunk_as_the_reference_packs_it(tmp_path):
    """wordpiece:VOCAB tokenizes as transformers' BertTokenizerFast on the same vocab.txt; with
    --chunk-bos every sequence is [CLS], L - 2 tokens of the stream of [CLS] sentence [SEP],
    [SEP] (MDLM's wrapped LM1B); the shipped tokenizer.json reloads with [SEP] as end-of-text."""
    transformers = pytest.importorskip("transformers")
    words = sorted(set(sample_text().lower().replace("\n", " ").split()))[:400]
    (tmp_path / "bert").mkdir()
    vocab = tmp_path / "bert" / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ",", ".", "'",
                                "?", "!", ";", ":"] + [w.strip(",.;:?!'") for w in words
                                                        if w.strip(",.;:?!'")]) + "\n")
    sentences = [s.strip() for s in sample_text().splitlines() if s.strip()][:40]
    src = tmp_path / "lm1b.jsonl"
    src.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences))
    ours = load_tokenizer(f"wordpiece:{vocab}")
    bert = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "bert"),
                                                      tokenizer_type="bert", do_lower_case=True)
    for s in sentences:
        assert ours.encode(s) == bert.encode(s, add_special_tokens=False), s
    cls, sep = bert.cls_token_id, bert.sep_token_id
    assert (ours.bos_id, ours.eos_id) == (cls, sep)
    L = 16
    m = prepare([str(src)], f"wordpiece:{vocab}", L, str(tmp_path / "out"), chunk_bos=True,
                valid_every=0, progress=False)
    assert m["mode"] == "packed+chunk-bos"
    shards = ShardSet(str(tmp_path / "out"))
    stream = [t for s in sentences for t in [cls] + bert.encode(s, add_special_tokens=False)
              + [sep]]
    for i in range(len(shards)):
        row = shards[i][0].tolist()
        assert row[0] == cls and row[-1] == sep and len(row) == L
        assert row[1:-1] == stream[i * (L - 2):(i + 1) * (L - 2)]
    assert len(shards) == len(stream) // (L - 2)
    shipped = load_shipped_tokenizer(str(tmp_path / "out"), m["tokenizer"])
    assert shipped.eos_id == sep and shipped.encode(sentences[0]) == ours.encode(sentences[0])
    with pytest.raises(PrepError, match="no beginning-of-sequence token"):
        prepare([str(src)], "bytes", L, str(tmp_path / "x"), chunk_bos=True, progress=False)


def test_lm1b_detokenizer_undoes_the_corpus_spacing_before_tokenizing(tmp_path):
    """--detokenize lm1b: LM1B's word-tokenized sentences get ordinary spacing (the reference's
    rules) before the tokenizer sees them; the manifest records it."""
    from data_prep.detokenize import lm1b

    cases = {"it 's here , he said .": "it's here, he said.",
             "see http : / / example": "see http://example",
             'a " quoted " word and ( this ) and [ that ] !': 'a "quoted" word and (this) and '
                                                               '[that]!',
             "why ? costs $ 5 or £ 4 : a ; b / c": "why? costs $5 or £4: a; b/c"}
    for raw, want in cases.items():
        assert lm1b(raw) == want
    src = tmp_path / "lm1b.jsonl"
    src.write_text("".join(json.dumps({"text": raw}) + "\n" for raw in cases))
    m = prepare([str(src)], "bytes", 8, str(tmp_path / "out"), valid_every=0, progress=False,
                detokenize="lm1b")
    assert m["options"]["detokenize"] == "lm1b"
    shards = ShardSet(str(tmp_path / "out"))
    stream = b"".join(bytes(t for t in shards[i][0].tolist() if t < 256)
                      for i in range(len(shards)))
    assert b"it's here, he said." in stream and b"it 's" not in stream
    with pytest.raises(PrepError, match="--detokenize"):
        prepare([str(src)], "bytes", 8, str(tmp_path / "x"), detokenize="owt", progress=False)


def test_a_held_out_test_file_is_prepared_as_a_validation_split(sonnets, tmp_path, capsys):
    """--split valid: every document in the valid split, the one setdiff-eval --task ppl and a
    run's data.valid_shards read (the LM1B recipe prepared its test set with --valid-every 0, a
    train split only, and its evaluation found no 'valid' samples); with the training shards'
    tokenizer the tokens are the ones a train split of the same text holds. --valid-every with
    --split is refused."""
    train = tmp_path / "train"
    m = prepare([sonnets], "bpe:300", 32, str(train), valid_every=0, workers=1, progress=False)
    test = tmp_path / "test"
    t = prepare([sonnets], str(train), 32, str(test), split="valid", workers=1, progress=False)
    assert set(t["splits"]) == {"valid"} and t["options"]["split"] == "valid"
    assert t["splits"]["valid"]["samples"] == m["splits"]["train"]["samples"]
    tok = load_shipped_tokenizer(str(test), t["tokenizer"])
    assert tok.sha256 == load_shipped_tokenizer(str(train), m["tokenizer"]).sha256
    s = ShardSet(str(test), "valid", seq_len=32, tokenizer_sha256=tok.sha256)
    ref = ShardSet(str(train), "train", seq_len=32, tokenizer_sha256=tok.sha256)
    assert (all_tokens(s) == all_tokens(ref)).all()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        prep_main(["--input", sonnets, "--tokenizer", "bytes", "--seq-len", "32", "--out",
              str(tmp_path / "x"), "--split", "valid", "--valid-every", "5"])
    assert exc.value.code == 2 and "--valid-every does not apply" in capsys.readouterr().err


def test_progress_bars_written_to_a_file_are_a_line_every_few_seconds(tmp_path, sonnets):
    """A progress bar on a terminal redraws as tqdm does; to a file or a Slurm log it writes a
    line every progress.LOG_INTERVAL_S seconds at most (setdiff-prep on 20,000 records wrote
    about 300 of them in 5 s), its postfix drawn with the next update, not on its own."""
    import io

    from setdiff_dist.progress import LOG_INTERVAL_S, bar

    log = io.StringIO()
    b = bar(file=log, total=2000, desc="x")
    for i in range(2000):
        b.update(1)
        b.set_postfix(i=i, refresh=False)
    b.close()
    assert len([s for s in log.getvalue().replace("\r", "\n").splitlines() if s]) <= 3
    assert b.mininterval == LOG_INTERVAL_S >= 5

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert bar(file=Terminal(), total=1).mininterval == 0.1  # (tqdm's own)
    err = tmp_path / "err.txt"
    with open(err, "w") as fh:
        import contextlib

        with contextlib.redirect_stderr(fh):
            prepare([sonnets], "bytes", 64, str(tmp_path / "out"), split_paragraphs=True,
                    workers=1, progress=True, valid_every=0)
    assert len([s for s in err.read_text().replace("\r", "\n").splitlines() if s]) <= 3


def test_exported_weights_are_readable_as_the_umask_allows(tmp_path):
    """Exports (setdiff-convert, --to-hf, --from-hf) write safetensors files, which safetensors
    creates 0600: an export made for others was not theirs to read. Now 0666 less the umask."""
    import stat

    import torch

    from setdiff_dist.checkpoint.files import _umask, save_tensors

    old = os.umask(0o022)
    try:
        assert _umask() == 0o022
        save_tensors({"w": torch.zeros(2)}, str(tmp_path / "a.safetensors"), {"format": "pt"})
        os.umask(0o077)
        save_tensors({"w": torch.zeros(2)}, str(tmp_path / "b.safetensors"), {"format": "pt"})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a.safetensors").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "b.safetensors").st_mode) == 0o600


@pytest.mark.timeout(120)
def test_a_built_in_tokenizers_shard_directory_tokenizes_a_held_out_split(sonnets, tmp_path):
    """--tokenizer SHARDS_DIR of GPT-2 shards (a built-in tokenizer: no file shipped) with
    tokenizer processes: they were given the directory and its manifest's end-of-text token,
    failed to load it, and multiprocessing's pool started them again forever (the command
    hung). They now load the tokenizer's own spec; a tokenizer process that cannot load one
    fails the command, naming why, instead of hanging."""
    from data_prep import prep

    train, test = tmp_path / "train", tmp_path / "test"
    prepare([sonnets], "gpt2", 64, str(train), split_paragraphs=True, valid_every=0,
            workers=2, progress=False)
    m = prepare([sonnets], str(train), 64, str(test), split_paragraphs=True, split="valid",
                workers=2, progress=False)
    assert m["tokenizer"]["spec"] == "gpt2" and set(m["splits"]) == {"valid"}
    prep._init_worker("no-such-tokenizer")
    try:
        with pytest.raises(PrepError, match="could not load the tokenizer: .*no-such-tokenizer"):
            prep._encode([("text", "")])
    finally:
        prep._INIT_ERROR = prep._TOKENIZER = None
