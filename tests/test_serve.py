"""setdiff-serve, talked to with the real OpenAI client on 127.0.0.1: greedy completions equal
setdiff-generate's whatever else is in the batch, streams add up to the completion, bad requests
get OpenAI's 400 body, a full queue 429, a client that leaves frees its row, SIGTERM drains, and
TP=2 under torchrun answers as TP=1. Pure logic (rows joining and leaving the batch) is checked
in this process."""

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from helpers import child_env, run_cli

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


class Server:
    """``setdiff-serve`` as a child process on a free port of 127.0.0.1."""

    def __init__(self, checkpoint, tmp, *extra, tp=1, name="tiny"):
        ready = tmp / f"ready-{time.monotonic_ns()}"
        self.log = open(tmp / f"serve-{time.monotonic_ns()}.log", "w+")
        args = ["--checkpoint", str(checkpoint), "--port", "0", "--ready-file", str(ready),
                "--served-model-name", name, "--log-level", "warning", *extra]
        if tp == 1:
            cmd = [sys.executable, "-m", "setdiff_dist.cli.serve", *args]
        else:
            from setdiff_dist.parallel import free_port

            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
                   "--master-port", str(free_port()), "-m", "setdiff_dist.cli.serve", *args,
                   "--tensor-parallel", str(tp)]
        self.name = name
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=child_env(), start_new_session=True)
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.1)
        self.url = f"http://{ready.read_text().strip()}"
        # where it listens, with the port it bound (the command line's was 0)
        assert f"setdiff-serve: listening on {self.url}/v1" in self.output(), self.output()
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                                    timeout=120)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-5000:]

    def complete(self, prompt, **kw):
        extra = {k: kw.pop(k) for k in ("window", "threshold", "ignore_eos",
                                        "return_token_ids", "repetition_penalty") if k in kw}
        extra.update(kw.pop("extra_body", {}))
        return self.client.completions.create(model=self.name, prompt=prompt, extra_body=extra,
                                              **kw)

    def metrics(self) -> dict:
        """The Prometheus samples by name (every one carries the served model's name, as
        vLLM's do; histogram buckets left out), ``requests_<outcome>`` and
        ``success_<finished_reason>``."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith("#") or 'le="' in line:
                continue
            name, value = line.rsplit(" ", 1)
            base, labels = name.split("{", 1)
            assert f'model_name="{self.name}"' in labels, line
            if base == "setdiff_requests_total":
                base = "requests_" + labels.split('outcome="')[1].split('"')[0]
            elif base == "vllm:request_success_total":
                base = "success_" + labels.split('finished_reason="')[1].split('"')[0]
            out[base] = float(value)
        return out

    def wait_for(self, what, timeout=60):
        deadline = time.monotonic() + timeout
        while not what(self.metrics()):
            assert time.monotonic() < deadline, self.metrics()
            time.sleep(0.02)

    def close(self):
        # torchrun's ranks run in sessions of their own: kill them by name, then torchrun
        ranks = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                               text=True).stdout.split()
        for pid in ranks:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def set_run(trained):
    """The session's reference set-diffusion run (staggered order, byte-level, context 32)."""
    return trained()


# a chat template in Hugging Face's form (Jinja over messages), for /v1/chat/completions
CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def server(set_run, tmp_path_factory):
    where = tmp_path_factory.mktemp("serve")
    (where / "chat.jinja").write_text(CHAT_TEMPLATE)
    s = Server(set_run, where, "--max-batch-size", "16", "--max-completion-tokens", "4096",
               "--chat-template", str(where / "chat.jinja"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def small(trained, tmp_path_factory):
    """A causal checkpoint (BPE) behind one row and a queue of one: the limits."""
    s = Server(trained("order.kind=causal", tokenizer="bpe:300"),
               tmp_path_factory.mktemp("small"), "--max-batch-size", "1", "--max-queue", "1",
               "--max-completion-tokens", "4096")
    yield s
    s.close()


GREEDY = dict(window=4, threshold=0.3, temperature=0, max_tokens=24)
# sampled, seeded (an untrained model's greedy text is mostly blanks), several tokens a step
SAMPLED = dict(window=8, threshold=0.05, temperature=1.0, seed=3, max_tokens=24)


def generate_cli(checkpoint, prompt, max_tokens, window, threshold):
    res = run_cli("setdiff_dist.cli.generate", "--checkpoint", checkpoint, "--prompt", prompt,
                  "--max-new-tokens", max_tokens, "--window", window, "--threshold",
                  threshold, "--greedy", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_greedy_completion_equals_setdiff_generate_alone_and_beside_others(server, set_run):
    prompt = "Shall I compare thee"
    want = generate_cli(set_run, prompt, 24, 4, 0.3)
    alone = server.complete(prompt, return_token_ids=True, **GREEDY)
    choice = alone.choices[0]
    assert choice.token_ids == want["tokens"][0] and choice.text == want["texts"][0]
    assert alone.usage.completion_tokens == len(want["tokens"][0])
    assert choice.forward_steps == want["steps"][0] and alone.usage.forward_steps > 0
    assert choice.finish_reason in ("stop", "length")
    # eight others of different lengths and settings (some sampled), then the same request
    # joining their running batch
    others = [dict(prompt=p, max_tokens=m, temperature=t, seed=i, window=w)
              for i, (p, m, t, w) in enumerate([
                  ("From fairest creatures", 60, 0, 2), ("When", 200, 0.9, 4),
                  ("Thy glass will show thee", 100, 0, 8), ("O", 150, 1.0, 1),
                  ("Devouring Time, blunt thou", 80, 0.7, 4), ("Look in", 120, 0, 4),
                  ("Music to hear", 90, 1.2, 2), ("Is it for fear", 130, 0, 16)])]
    results, errors = {}, []

    def ask(key, **kw):
        try:
            results[key] = server.complete(**kw)
        except Exception as exc:  # (reported below)
            errors.append(repr(exc))

    threads = [threading.Thread(target=ask, args=(i,), kwargs=kw) for i, kw in
               enumerate(others)]
    for t in threads:
        t.start()
    server.wait_for(lambda m: m["vllm:num_requests_running"] >= 4)
    ask("target", prompt=prompt, return_token_ids=True, **GREEDY)
    for t in threads:
        t.join()
    assert not errors, errors
    beside = results["target"].choices[0]
    assert beside.largest_batch > 1, "the request did not share the batch"
    assert beside.token_ids == want["tokens"][0] and beside.text == want["texts"][0]
    # sampled requests are reproducible from their seed, whatever they ran beside
    again = server.complete(**others[1])
    assert again.choices[0].text == results[1].choices[0].text


def test_streamed_chunks_add_up_to_the_completion(server):
    """How many chunks a stream has depends on how far the HTTP side falls behind the decoding
    steps (``_coalesced`` folds what waits; checked without timing below), so this asserts what
    every pace gives: the text, one finish reason at the end, then the usage."""
    for prompt, settings in (("Shall I compare thee", GREEDY), ("Rough winds", SAMPLED)):
        whole = server.complete(prompt, **settings).choices[0].text
        chunks = list(server.complete(prompt, stream=True, stream_options={
            "include_usage": True}, **settings))
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(texts) == whole and whole
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")
        assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
        assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices


def test_a_stream_sends_each_step_it_keeps_up_with_and_folds_what_waits():
    """``_coalesced``, the stream's reader of its events: a reader that keeps up gets one chunk
    per decoding step; one that fell behind gets the waiting steps of a choice as one chunk
    (text and token ids joined in order, a Finished taking the text before it), never folded
    across choices or into an error, and nothing taken from the queue is lost."""
    from setdiff_dist.serve.app import _coalesced
    from setdiff_dist.serve.messages import Failed, Finished, Text

    end = Finished("length", [1, 2, 3, 4, 5], 3, 4, 1, 0.1, 0.01)

    async def read(feed):
        """Put each batch of ``feed`` on the queue only once everything before it was read."""
        events, backlog, got = asyncio.Queue(), collections.deque(), []
        for batch in feed:
            for item in batch:
                events.put_nowait(item)
            while not events.empty() or backlog:
                got.append(await _coalesced(events, backlog))
        return got

    steps = [(0, Text("Shall", (1,))), (0, Text(" I", (2, 3))), (0, Text(" compare", (4,))),
             (0, end)]
    kept_up = asyncio.run(read([[s] for s in steps]))
    assert kept_up == steps
    behind = asyncio.run(read([steps]))
    assert behind == [(0, Finished(**{**end.__dict__, "text": "Shall I compare"}))]
    assert asyncio.run(read([steps[:3]])) == [(0, Text("Shall I compare", (1, 2, 3, 4)))]
    # two choices of one request, interleaved, and an error: folded within a choice only
    mixed = [(0, Text("a", (1,))), (0, Text("b", (2,))), (1, Text("x", (7,))),
             (0, Text("c", (3,))), (1, Failed("boom")), (1, Text("late", (8,)))]
    assert asyncio.run(read([mixed])) == [
        (0, Text("ab", (1, 2))), (1, Text("x", (7,))), (0, Text("c", (3,))),
        (1, Failed("boom")), (1, Text("late", (8,)))]


def test_unseeded_sampled_requests_differ_and_their_seed_repeats_them(server):
    """Four unseeded sampled completions are four samples (an unseeded request was seed 0:
    they gave one text, and pass@k by repeated requests scored duplicates); each response
    carries the seed it ran with, and that seed repeats it, streamed or not."""
    unseeded = {k: v for k, v in SAMPLED.items() if k != "seed"}
    got = [server.complete("Rough winds", **unseeded) for _ in range(4)]
    texts, seeds = [g.choices[0].text for g in got], [g.model_extra["seed"] for g in got]
    assert len(set(texts)) > 1 and len(set(seeds)) == 4, (texts, seeds)
    again = server.complete("Rough winds", seed=seeds[2], **unseeded)
    assert again.choices[0].text == texts[2] and again.model_extra["seed"] == seeds[2]
    chunks = list(server.complete("Rough winds", stream=True, seed=seeds[2], **unseeded))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == texts[2]
    assert {c.model_extra["seed"] for c in chunks} == {seeds[2]}


def test_n_completions_are_independent_rows_each_repeatable_from_its_seed(server):
    """n=3 returns three choices of one prompt, sampled as independent rows of the batch: the
    k-th with the response's seed + k, which a request of its own repeats; with two prompts,
    choice i x n + k is prompt i's k-th."""
    seeded = dict(SAMPLED, seed=11)
    three = server.complete("Rough winds", n=3, **seeded)
    texts = [c.text for c in three.choices]
    assert [c.index for c in three.choices] == [0, 1, 2] and len(set(texts)) > 1, texts
    for k in range(3):
        alone = server.complete("Rough winds", **dict(seeded, seed=11 + k))
        assert alone.choices[0].text == texts[k]
    two = server.complete(["Rough winds", "Shall I"], n=2, **seeded)
    assert [c.text for c in two.choices][:2] == texts[:2]
    assert two.usage.completion_tokens == sum(
        server.complete(p, **dict(seeded, seed=11 + k)).usage.completion_tokens
        for p in ("Rough winds", "Shall I") for k in range(2))
    # vLLM's top_k: 1 samples the argmax (one candidate a step: window 1), whatever the seed
    argmax = [server.complete("Rough winds", window=1, max_tokens=8, temperature=1.0, seed=s,
                              extra_body={"top_k": 1}).choices[0].text for s in (1, 2)]
    greedy = server.complete("Rough winds", window=1, max_tokens=8, temperature=0)
    assert argmax == [greedy.choices[0].text] * 2


def test_chat_completions_render_the_template_and_answer_as_openai_does(server, small):
    """/v1/chat/completions: the messages through the chat template (--chat-template), then a
    completion of that prompt, answered as OpenAI's chat objects (message; streamed: deltas
    that add up to it, the role in the first); a checkpoint without a template says how to
    give one."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "Rough"}]}]  # (context 32)
    chat = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                                 temperature=0, seed=5,
                                                 extra_body={"window": 4, "threshold": 0.3})
    plain = server.complete("user: Rough\nassistant:", max_tokens=8,
                            temperature=0, window=4, threshold=0.3)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    message = chat.choices[0].message
    assert message.role == "assistant" and message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens
    parts = list(server.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True,
        extra_body={"window": 4, "threshold": 0.3}))
    assert all(p.object == "chat.completion.chunk" for p in parts)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == message.content
    with pytest.raises(openai.BadRequestError, match="--chat-template"):
        small.client.chat.completions.create(model=small.name, messages=messages, max_tokens=4)


def test_lm_evals_local_completions_scores_as_setdiff_lm_eval_does(small, trained, set_run,
                                                                     server, tmp_path):
    """echo + logprobs, as lm-eval's local-completions asks them (its remote tokenizer reading
    /tokenizer_info, /tokenize): lm-eval's own API model against the server gives the
    per-choice log-likelihoods setdiff-lm-eval gives on the checkpoint itself (1e-4); on a
    set-diffusion checkpoint, the echoed log-probs are the API's loglikelihood."""
    import glob

    def choice_lls(where):
        path = glob.glob(str(where / "**" / "samples_setdiff_choice_*.jsonl"), recursive=True)
        return {s["doc_id"]: [float(r[0][0]) for r in s["resps"]]
                for s in map(json.loads, open(path[0]))}

    args = ["--tasks", "setdiff_choice", "--include_path", os.path.join("tests", "harness"),
            "--log_samples", "--output_path"]
    res = run_cli("setdiff_dist.cli.lm_eval", "--model", "local-completions", "--model_args",
                  f"base_url={small.url}/v1/completions,model={small.name},"
                  "tokenizer_backend=remote,tokenized_requests=True,num_concurrent=1,"
                  "max_retries=1", *args, tmp_path / "remote")
    assert res.returncode == 0, res.stderr[-3000:]
    run = trained("order.kind=causal", tokenizer="bpe:300")
    res = run_cli("setdiff_dist.cli.lm_eval", "--model", "setdiff", "--model_args",
                  f"pretrained={run}", *args, tmp_path / "local")
    assert res.returncode == 0, res.stderr[-3000:]
    remote, local = choice_lls(tmp_path / "remote"), choice_lls(tmp_path / "local")
    assert sorted(remote) == sorted(local) == list(range(8))
    for i in local:
        assert remote[i] == pytest.approx(local[i], abs=1e-4), i
    # a set-diffusion checkpoint: its autoregressive-order log-likelihood, echoed
    prompt = [ord(c) for c in "Rough winds"]
    out = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                           temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens[:len(prompt)] == list("Rough winds") and lp.token_logprobs[0] is None
    assert len(lp.top_logprobs[1]) == 2 and out.choices[0].text.startswith("Rough winds")
    # max_tokens=0 with echo: the prompt alone, scored, nothing generated (OpenAI's)
    only = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=0,
                                            echo=True, logprobs=2)
    c = only.choices[0]
    assert c.text == "Rough winds" and c.logprobs.tokens == list("Rough winds")
    assert c.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:len(prompt)],
                                                          abs=1e-5)
    assert only.usage.completion_tokens == 0 and c.finish_reason == "length"
    import setdiff_dist
    from setdiff_dist.parallel import destroy_model_parallel

    saved = dict(os.environ)
    try:  # (the process group and variables load sets up end with the test)
        want = setdiff_dist.load(set_run).loglikelihood([("Rough", " winds")])[0][0]
    finally:
        destroy_model_parallel()
        os.environ.clear()
        os.environ.update(saved)
    assert sum(lp.token_logprobs[5:len(prompt)]) == pytest.approx(want, abs=1e-4)
    # streamed: the prompt with the first chunk, each chunk its tokens' scores; together they
    # are the unstreamed answer's (how many chunks depends on the server's pace: a reader that
    # fell behind gets the waiting steps folded into one, test_a_stream_sends_each_step...)
    ask = dict(SAMPLED, max_tokens=16, echo=True, logprobs=2)
    whole = server.complete("Rough winds", **ask).choices[0]
    chunks = [c.choices[0] for c in server.complete("Rough winds", stream=True, **ask)]
    assert chunks and "".join(c.text for c in chunks) == whole.text
    assert chunks[0].text.startswith("Rough winds")
    same_scores(sum_logprobs(c.logprobs for c in chunks), whole.logprobs, 1e-5)


def sum_logprobs(objects):
    """The ``logprobs`` objects of a stream's chunks, end to end."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in objects:
        for k in out:
            out[k] += getattr(lp, k)
    return SimpleNamespace(**out)


def same_scores(got, want, tol):
    assert got.tokens == want.tokens and got.text_offset == want.text_offset
    assert got.token_logprobs[0] is None is want.token_logprobs[0]
    assert got.token_logprobs[1:] == pytest.approx(want.token_logprobs[1:], abs=tol)
    for g, w in zip(got.top_logprobs[1:], want.top_logprobs[1:], strict=True):
        assert sorted(g) == sorted(w) and [g[t] for t in sorted(g)] == \
            pytest.approx([w[t] for t in sorted(w)], abs=tol)


def test_stop_strings_end_the_text_before_them(server):
    whole = server.complete("Shall I compare thee", **SAMPLED).choices[0].text
    stop = whole[8:10]
    cut = server.complete("Shall I compare thee", stop=[stop], **SAMPLED).choices[0]
    assert cut.text == whole[:whole.find(stop)] and cut.finish_reason == "stop"
    streamed = server.complete("Shall I compare thee", stop=[stop], stream=True, **SAMPLED)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_bad_requests_get_an_openai_error_and_nothing_else_changes(server):
    before = server.metrics()
    url = f"{server.url}/v1/completions"
    raw = httpx.post(url, content=b'{"model": "tiny", "prompt": ', timeout=30,
                     headers={"Content-Type": "application/json"})
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    assert raw.json()["error"]["type"] == "invalid_request_error"
    cases = [(dict(presence_penalty=0.5), "presence_penalty=0.5 is not supported"),
             (dict(logprobs=21), "logprobs"),
             (dict(temperature=5), "temperature"), (dict(top_p=0), "top_p"),
             (dict(max_tokens=0), "max_tokens"), (dict(window=0), "window"),
             (dict(n=0), "n"), (dict(threshold=-1), "threshold"),
             (dict(prompt="x" * 40), "context of 32 tokens")]
    for fields, said in cases:
        body = {"model": "tiny", "prompt": "Shall I", **fields}
        res = httpx.post(url, json=body, timeout=30)
        assert res.status_code == 400, (fields, res.text)
        assert said in res.json()["error"]["message"], (fields, res.text)
    # OpenAI's own fields at their no-op values are taken (they were each a 400), and a field
    # OpenAI does not define is ignored with a warning in the log, as vLLM does (--strict:
    # refused; test_strict_refuses_fields_openai_does_not_define)
    ok = server.complete("Shall I", presence_penalty=0, frequency_penalty=0, logit_bias={},
                         echo=False, best_of=1, user="u", extra_body={"frequency_bogus": 2},
                         **GREEDY)
    assert ok.choices[0].text == server.complete("Shall I", **GREEDY).choices[0].text
    assert "fields this server does not take were ignored: frequency_bogus" in server.output()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.completions.create(model="gpt-4", prompt="Shall I")
    after = server.metrics()
    assert after["requests_bad_request"] - before["requests_bad_request"] == len(cases) + 2
    assert after["requests_completed"] == before["requests_completed"] + 2  # (the two above)
    assert server.complete("Shall I", **GREEDY).choices[0].text  # (still serving)


def test_strict_refuses_fields_openai_does_not_define():
    """setdiff-serve --strict keeps the old rule: a field OpenAI's completions do not define is
    a 400 naming it; the default body model takes it (and the route logs it as ignored)."""
    from types import SimpleNamespace

    import pydantic

    from setdiff_dist.serve.app import (
        CompletionRequest,
        Service,
        StrictCompletionRequest,
        create_app,
    )

    body = {"model": "m", "prompt": "x", "bogus": 1}
    assert CompletionRequest.model_validate(body).model_extra == {"bogus": 1}
    with pytest.raises(pydantic.ValidationError, match="bogus"):
        StrictCompletionRequest.model_validate(body)
    service = Service(SimpleNamespace(context=32), "m", None, None)
    for strict, model in ((False, CompletionRequest), (True, StrictCompletionRequest)):
        route = next(r for r in create_app(service, strict=strict).routes
                     if getattr(r, "path", "") == "/v1/completions")
        assert route.dependant.body_params[0].field_info.annotation is model


def test_models_health_and_metrics(server):
    models = server.client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].max_model_len == 32
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    server.complete("Rough winds", max_tokens=6, temperature=0)  # (something to count)
    m = server.metrics()
    # vLLM's names and model_name label (its dashboards apply), and set decoding's own
    for name in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                 "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:e2e_request_latency_seconds_count",
                 "vllm:time_to_first_token_seconds_count",
                 "vllm:time_per_output_token_seconds_count",
                 "vllm:request_queue_time_seconds_count", "setdiff_tokens_per_step_count",
                 "setdiff_step_seconds_count", "setdiff_step_batch_size_count"):
        assert name in m, name
    assert m["vllm:generation_tokens_total"] > 0 and m["requests_completed"] > 0
    assert m["success_stop"] + m["success_length"] == m["requests_completed"]
    assert m["vllm:time_per_output_token_seconds_count"] > 0
    assert not [k for k in m if k.endswith("_created")]  # (no series dashboards never read)
    # vLLM's /tokenize and /detokenize, under the model's tokenizer, both ways
    ids = httpx.post(f"{server.url}/tokenize", json={"model": "tiny",
                                                      "prompt": "Rough winds"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 32
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids["tokens"]}).json()
    assert text == {"prompt": "Rough winds"}
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    other = httpx.post(f"{server.url}/tokenize", json={"model": "x", "prompt": "a"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    # /tokenizer_info, which lm-eval's remote tokenizer reads: its eos_token tokenizes to the
    # end-of-text id (lm-eval takes encode(eos_token)[0])
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    eos = httpx.post(f"{server.url}/tokenize", json={"prompt": info["eos_token"]}).json()
    assert eos["tokens"] == [256] and info["chat_template"] == CHAT_TEMPLATE
    both = httpx.post(f"{server.url}/tokenize",
                      json={"prompt": "a" + info["eos_token"] + "b"}).json()["tokens"]
    assert both == [ord("a"), 256, ord("b")]


def _long(small, **kw):
    """A request that holds the one row for a while (thousands of causal steps)."""
    return small.complete("Shall I", max_tokens=4000, ignore_eos=True, temperature=0, **kw)


def test_a_full_queue_answers_429_and_a_client_that_leaves_frees_its_row(small):
    base = small.metrics()
    stream = _long(small, stream=True)
    next(iter(stream))  # it runs
    small.wait_for(lambda m: m["vllm:num_requests_running"] == 1)
    queued = {}
    waiter = threading.Thread(target=lambda: queued.setdefault(
        "r", small.complete("Shall I", max_tokens=5, temperature=0)))
    waiter.start()
    small.wait_for(lambda m: m["vllm:num_requests_waiting"] == 1)
    res = httpx.post(f"{small.url}/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "Shall I", "max_tokens": 5})
    assert res.status_code == 429 and res.headers["Retry-After"] == "1"
    assert res.json()["error"]["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError):
        small.complete("Shall I", max_tokens=5)
    # the streaming client goes away: its row is freed and the queued request runs
    stream.close()
    waiter.join(timeout=60)
    assert not waiter.is_alive() and len(queued["r"].choices[0].text) > 0
    m = small.metrics()
    assert m["requests_cancelled"] - base["requests_cancelled"] == 1
    assert m["requests_rejected_queue_full"] - base["requests_rejected_queue_full"] == 2
    # a non-streamed request whose client times out is freed as well
    with pytest.raises(openai.APITimeoutError):
        _long(small, timeout=1.0)
    small.wait_for(lambda m: m["requests_cancelled"] - base["requests_cancelled"] == 2
                   and m["vllm:num_requests_running"] == 0, timeout=30)


def test_sigterm_finishes_the_requests_in_flight_and_exits_0(small):
    got, errors = [], []

    def ask():
        try:
            got.append(small.complete("Shall I", max_tokens=2000, ignore_eos=True,
                                      temperature=0))
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    threads[0].start()  # it runs (one row) ...
    small.wait_for(lambda m: m["vllm:num_requests_running"] == 1)
    threads[1].start()  # ... and this one waits (a queue of one)
    small.wait_for(lambda m: m["vllm:num_requests_running"] == 1
                   and m["vllm:num_requests_waiting"] == 1)
    small.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no new connections
        httpx.get(f"{small.url}/health", timeout=5)
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [r.usage.completion_tokens for r in got] == [2000, 2000]
    assert small.proc.wait(timeout=60) == 0, small.output()


def test_rows_that_join_and_leave_the_batch_decode_as_they_would_alone(set_run):
    """In this process: requests join a running :class:`ContinuousBatch` at different steps,
    greedy and sampled, with their own windows and thresholds; each decodes the tokens
    ``SetDecoder.generate`` gives it alone, and its stream of text adds up to its text."""
    from setdiff_dist.inference.decoder import Sampling, SetDecoder, StopCriteria
    from setdiff_dist.inference.weights import build_inference_model
    from setdiff_dist.parallel import destroy_model_parallel
    from setdiff_dist.serve.batch import ContinuousBatch, Spec
    from setdiff_dist.serve.text import TextStream

    saved = dict(os.environ)
    try:
        model, cfg, tok = build_inference_model(str(set_run))
        dec = SetDecoder(model, tok, context=cfg.data.seq_len)
        settings = [("Shall I compare thee", 40, 4, 0.3, 0.0), ("When", 12, 8, 0.05, 1.0),
                    ("O", 70, 2, 0.5, 0.0), ("Thy glass", 30, 8, 0.02, 1.3),
                    ("Look in thy", 5, 1, 2.0, 0.0), ("From", 50, 16, 0.1, 0.8),
                    ("Thou art more lovely", 8, 2, 0.5, 0.0)]
        specs = [Spec(id=str(i), prompt=tuple(tok.encode(p)), max_tokens=m, window=w,
                      threshold=th, greedy=t == 0, temperature=t or 1.0, top_p=1.0,
                      repetition_penalty=1.0, seed=i)
                 for i, (p, m, w, th, t) in enumerate(settings)]
        alone = {}
        for s in specs:
            sampling = Sampling(greedy=s.greedy, temperature=s.temperature, seed=s.seed)
            alone[s.id] = dec.generate([list(s.prompt)], s.max_tokens, window=s.window,
                                       threshold=s.threshold, sampling=sampling,
                                       stop=StopCriteria(eos_id=tok.eos_id))[0].tokens
        batch, joins = ContinuousBatch(dec), {0: specs[:2], 1: specs[2:3], 3: specs[3:5],
                                               5: specs[6:], 9: specs[5:6]}
        apart = []  # (the long prompt's first step runs beside the batch's, not padding it)
        batch._prefill_apart = lambda old, new: apart.append(
            ContinuousBatch._prefill_apart(old, new)) or apart[-1]
        got, streamed, streams, out_of_order, step = {}, {}, {}, False, 0
        while joins or len(batch):
            rows, refused = batch.admit(joins.pop(step, []))
            assert not refused
            for row in rows:
                streams[row.spec.id] = TextStream(tok)
                streamed[row.spec.id] = ""
            rows = list(batch.rows)
            for row in batch.step():
                got[row.spec.id] = row
            for row in rows:
                text, s = streams[row.spec.id], row.sample
                streamed[row.spec.id] += text.finish(s.output()) if s.done else \
                    text.push(row.new_prefix())
                out_of_order |= any(p not in s.region[:s.left] for p, _ in s.pending)
            step += 1
    finally:
        destroy_model_parallel()
        os.environ.clear()
        os.environ.update(saved)
    assert {k: r.sample.output() for k, r in got.items()} == alone
    assert max(r.largest_batch for r in got.values()) >= 4
    assert True in apart and False in apart, apart
    assert out_of_order, "no step committed a position past the contiguous prefix"
    for k in got:
        assert streamed[k] == tok.decode(alone[k])


def test_tensor_parallel_serving_under_torchrun_answers_as_tp1(server, set_run, tmp_path):
    """TP=2 under torchrun (rank 0 serves HTTP and sends each step's plan; both ranks decode
    their shard): the same completions as the TP=1 server, alone and batched."""
    two = Server(set_run, tmp_path, "--max-batch-size", "8", "--max-completion-tokens", "4096",
                 tp=2)
    try:
        asks = [("Shall I compare thee", GREEDY), ("When in disgrace", dict(GREEDY, window=8)),
                ("Rough winds", SAMPLED), ("O", dict(SAMPLED, window=2, max_tokens=40))]
        want = [server.complete(p, return_token_ids=True, **kw).choices[0].token_ids
                for p, kw in asks]
        got = {}
        threads = [threading.Thread(target=lambda i=i, p=p, kw=kw: got.__setitem__(
            i, two.complete(p, return_token_ids=True, **kw).choices[0])) for i, (p, kw) in
            enumerate(asks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [got[i].token_ids for i in range(len(asks))] == want
        assert max(c.largest_batch for c in got.values()) > 1
        alone = two.complete(asks[0][0], return_token_ids=True, **asks[0][1])
        assert alone.choices[0].token_ids == want[0]
        # echo / logprobs at TP=2 (every rank scores; the normaliser reduced and each rank's
        # top k gathered over the group): TP=1's scores
        ask = dict(GREEDY, max_tokens=6, echo=True, logprobs=3)
        one, tp2 = (s.complete("When in disgrace", **ask).choices[0] for s in (server, two))
        assert tp2.text == one.text
        same_scores(tp2.logprobs, one.logprobs, 1e-4)
        # a rank that dies mid-request: the request fails at once with the reason (it does
        # not hang), and rank 0 exits 1 so that the job ends and can be restarted
        rank1 = [int(p) for p in subprocess.run(["pgrep", "-P", str(two.proc.pid)],
                                                capture_output=True, text=True).stdout.split()
                 if "RANK=1" in open(f"/proc/{p}/environ").read().split("\0")]
        failed = []
        asker = threading.Thread(target=lambda: failed.append(pytest.raises(
            openai.APIStatusError, _long, two).value))
        asker.start()
        two.wait_for(lambda m: m["vllm:num_requests_running"] == 1)
        os.kill(rank1[0], signal.SIGKILL)
        asker.join(timeout=60)
        assert failed and "tensor-parallel" in str(failed[0]), failed
        assert two.proc.wait(timeout=60) != 0
    finally:
        two.close()


def test_a_server_that_cannot_start_says_why(tmp_path):
    from setdiff_dist.serve.batch import ContinuousBatch

    res = run_cli("setdiff_dist.cli.serve", "--checkpoint", tmp_path / "nothing")
    assert res.returncode == 2 and "nothing" in res.stderr, res.stderr
    with pytest.raises(ValueError, match="the mdlm baseline's sampler, which setdiff-generate"):
        ContinuousBatch(type("MDLM", (), {"decoding": "mdlm"})())


def test_the_http_process_and_rank_0_end_together(set_run, tmp_path):
    """Rank 0 decodes and a process it spawned serves HTTP: if that process dies, rank 0 says
    so and exits 1 (to be restarted) instead of decoding for nobody; if rank 0 is killed, the
    HTTP process goes too (the kernel's parent-death signal) instead of holding the port."""
    def http_pid(server):
        kids = subprocess.run(["pgrep", "-P", str(server.proc.pid), "-f", "spawn_main"],
                              capture_output=True, text=True).stdout.split()
        assert len(kids) == 1, kids
        return int(kids[0])

    s = Server(set_run, tmp_path)
    try:
        assert s.complete("Shall I", **GREEDY).choices[0].finish_reason
        os.kill(http_pid(s), signal.SIGKILL)
        assert s.proc.wait(timeout=60) == 1
        assert "the HTTP process ended with exit code -9" in s.output()
    finally:
        s.close()
    s = Server(set_run, tmp_path)
    try:
        child = http_pid(s)
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{child}") and \
                open(f"/proc/{child}/stat").read().split()[2] != "Z":
            assert time.monotonic() < deadline, "the HTTP process outlived rank 0"
            time.sleep(0.1)
        # nothing answers there: refused, or (when another process of the machine has since
        # bound the freed port, as CI's second test session can) not HTTP
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{s.url}/health", timeout=5)
    finally:
        s.close()


# -- the red team's cases (issue 49): one request never takes the server down --------------------

def test_bad_requests_beside_three_running_get_a_400_and_the_three_finish(server):
    """With three requests decoding, a max_tokens that cannot be held, a temperature or a
    repetition penalty the float32 sampler cannot divide by, NaN, a window wider than the
    context, a lone surrogate, more prompts than the queue and a body no JSON parser can
    read each get OpenAI's 400 at once; the three finish with their full text."""
    three = dict(max_tokens=2000, window=1, threshold=2.0, temperature=0,
                 ignore_eos=True)
    prompts = ["From fairest creatures", "When forty winters", "Look in thy glass"]
    got, errors = {}, []

    def ask(i):
        try:
            got[i] = server.complete(prompts[i], **three)
        except Exception as exc:  # (reported below)
            errors.append(repr(exc))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    server.wait_for(lambda m: m["vllm:num_requests_running"] >= 3)
    url = f"{server.url}/v1/completions"
    cases = [(dict(max_tokens=10 ** 12), "max_tokens=1000000000000 is more than this server "
              "allows (4096"), (dict(max_tokens=2 ** 63), "allows (4096"),
             (dict(max_tokens=4097), "--max-completion-tokens"),
             (dict(temperature=1e-38), "float32's smallest normal number"),
             (dict(repetition_penalty=1e-300), "repetition_penalty=1e-300"),
             (dict(window=100000), "give a window of at most 31"),
             (dict(prompt="\ud800abc"), "not valid UTF-8"),
             (dict(prompt=["x"] * 65), "queues at most 64 (--max-queue)")]
    for fields, said in cases:  # (json.dumps: escapes the lone surrogate as JSON may)
        res = httpx.post(url, content=json.dumps({"model": "tiny", "prompt": "Shall I",
                                                  **fields}), timeout=30,
                         headers={"Content-Type": "application/json"})
        assert res.status_code == 400, (fields, res.text)
        assert said in res.json()["error"]["message"], (fields, res.text)
    for body, said in ((b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "finite"),
                       (b'{"model": "tiny", "prompt": "x", "threshold": NaN}', "NaN"),
                       (b"[" * 100000 + b"]" * 100000, "cannot be parsed")):
        res = httpx.post(url, content=body, timeout=30,
                         headers={"Content-Type": "application/json"})
        assert res.status_code == 400 and said in res.json()["error"]["message"], res.text
    res = httpx.get(f"{server.url}/v1/nothing", timeout=30)
    assert res.status_code == 404 and res.json()["error"]["message"] == "Not Found"
    assert server.metrics()["vllm:num_requests_running"] >= 3  # (all of it beside the three)
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    alone = server.complete(prompts[0], **three).choices[0].text
    assert [got[i].usage.completion_tokens for i in range(3)] == [2000] * 3
    assert got[0].choices[0].text == alone and all(
        got[i].choices[0].finish_reason == "length" for i in range(3))
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_a_request_that_fails_alone_leaves_the_others_decoding(set_run):
    """In this process, the scheduler's own loop: a request that cannot join the batch (a
    length no list can hold, a temperature below float32's range: what the HTTP side
    refuses, sent past it) and a request whose logits are NaN in a step (a broken input) each
    get their own error; the requests beside them finish with the tokens they decode alone,
    and the scheduler goes on."""
    import math

    import torch

    from setdiff_dist.inference.decoder import Sampling, SetDecoder, StopCriteria
    from setdiff_dist.inference.weights import build_inference_model
    from setdiff_dist.parallel import destroy_model_parallel
    from setdiff_dist.serve.batch import Spec
    from setdiff_dist.serve.messages import Failed, Finished
    from setdiff_dist.serve.scheduler import Scheduler

    saved = dict(os.environ)
    try:
        model, cfg, tok = build_inference_model(str(set_run))
        dec = SetDecoder(model, tok, context=cfg.data.seq_len)
        poison = 7  # (a byte no sonnet has: a prompt with it gets NaN logits)
        forward = model.forward

        def broken(tokens, *args, **kwargs):
            out = forward(tokens, *args, **kwargs)
            hit = (tokens == poison).any(1)
            return torch.where(hit[None, :, None], torch.full_like(out, math.nan), out)

        model.forward = broken

        def spec(i, prompt, **kw):
            base = dict(id=str(i), prompt=tuple(prompt), max_tokens=24, window=4,
                        threshold=0.3, greedy=True, temperature=1.0, top_p=1.0,
                        repetition_penalty=1.0, seed=i)
            return Spec(**{**base, **kw})

        good = [spec(i, tok.encode(p)) for i, p in enumerate(
            ["Shall I compare thee", "When in disgrace", "Rough winds do shake"])]
        bad = [spec(10, tok.encode("Thy"), max_tokens=10 ** 12),
               spec(11, tok.encode("Thy"), max_tokens=2 ** 63),
               spec(12, tok.encode("Thy"), greedy=False, temperature=1e-38),
               spec(13, [poison] + tok.encode("Thy glass"))]
        alone = {s.id: dec.generate([list(s.prompt)], s.max_tokens, window=s.window,
                                    threshold=s.threshold, sampling=Sampling(greedy=True),
                                    stop=StopCriteria(eos_id=tok.eos_id))[0].tokens
                 for s in good}
        sched = Scheduler(dec, max_batch=8, max_queue=16)
        events, done = {}, threading.Event()

        def listen(key):
            def got(ev):
                events.setdefault(key, []).append(ev)
                if sum(e.done for evs in events.values() for e in evs) == 7:
                    done.set()
            return got

        for s in good[:2]:
            sched.submit(s, listen(s.id), streamed=True)
        sched.start()
        for s in bad + good[2:]:
            sched.submit(s, listen(s.id), streamed=True)
        assert done.wait(120), events
        for s in bad:
            assert isinstance(events[s.id][-1], Failed), events[s.id]
        assert "could not join the batch" in events["10"][-1].error
        assert "not a finite number" in events["13"][-1].error
        for s in good:
            last = events[s.id][-1]
            assert isinstance(last, Finished) and last.tokens == alone[s.id], last
        assert sched.status().alive and sched.status().running == 0
        sched.stop(timeout=30)
        assert not sched.thread.is_alive()
    finally:
        destroy_model_parallel()
        os.environ.clear()
        os.environ.update(saved)


def test_a_step_walks_its_window_not_the_rest_of_the_region():
    """A row's step looks at its window, however far its region goes: the work of a step
    beside a request of any length does not grow with that length (here, positions read)."""
    from setdiff_dist.inference.decoding import Sample

    class Counted:
        """A region that counts the positions read from it."""

        def __init__(self, r):
            self.r, self.reads = r, 0

        def __len__(self):
            return len(self.r)

        def __getitem__(self, i):
            out = self.r[i]
            self.reads += len(out) if isinstance(i, slice) else 1
            return out

        def __iter__(self):
            for p in self.r:
                self.reads += 1
                yield p

    s = Sample.continuation([1, 2, 3], 10 ** 6)
    s.region = Counted(s.region)
    s.commit([(3, 5), (4, 6), (6, 7)])
    assert s.window(8) == [5, 7, 8, 9, 10, 11, 12] and s.masked(2) == [5, 7]
    assert s.region.reads < 50, s.region.reads
    assert s.seen() == {1, 2, 3, 5, 6, 7}
    s.commit([(p, 9) for p in range(5, 40) if p != 6])
    assert s.seen() == {1, 2, 3, 5, 6, 7, 9} and s.window(4) == [40, 41, 42, 43]
    assert s.region.reads < 150, s.region.reads


KEY = "sk-setdiff-test"


@pytest.fixture(scope="module")
def guarded(set_run, tmp_path_factory):
    """A server with an API key, a small body limit, short header and body timeouts, few
    connections and a short drain (its last test stops it)."""
    s = Server(set_run, tmp_path_factory.mktemp("guarded"), "--api-key", KEY,
               "--max-body-bytes", "65536", "--timeout-header", "1", "--timeout-idle", "2",
               "--max-connections", "40", "--max-completion-tokens", "100000",
               "--shutdown-timeout", "3")
    s.client = openai.OpenAI(base_url=f"{s.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    s.headers = {"Authorization": f"Bearer {KEY}"}
    yield s
    s.close()


def test_the_api_key_is_required_on_v1_and_nowhere_else(guarded):
    url = f"{guarded.url}/v1/completions"
    body = {"model": "tiny", "prompt": "Shall I", "max_tokens": 4}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        res = httpx.post(url, json=body, headers=headers, timeout=30)
        assert res.status_code == 401, res.text
        assert res.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong",
                      max_retries=0).models.list()
    assert [m.id for m in guarded.client.models.list().data] == ["tiny"]
    assert guarded.complete("Shall I", max_tokens=4).usage.completion_tokens <= 4
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert guarded.metrics()["requests_unauthorized"] == 4


def test_a_public_bind_without_a_key_is_warned_about():
    res = run_cli("setdiff_dist.cli.serve", "--checkpoint", "/nonexistent", "--host", "0.0.0.0")
    assert "listening on 0.0.0.0 without an API key" in res.stderr and res.returncode == 2
    res = run_cli("setdiff_dist.cli.serve", "--checkpoint", "/nonexistent", "--host",
                  "0.0.0.0", "--api-key", "k")
    assert "without an API key" not in res.stderr and res.returncode == 2


def test_bodies_are_bounded_in_size_and_pace(guarded):
    url = f"{guarded.url}/v1/completions"
    big = json.dumps({"model": "tiny", "prompt": "x" * 70000})
    res = httpx.post(url, content=big, headers=guarded.headers, timeout=30)
    assert res.status_code == 413 and "--max-body-bytes" in res.json()["error"]["message"]
    import socket

    host, port = guarded.url[len("http://"):].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # a body that stalls
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}"
                     "\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mo"
                     .encode())
        answer = b""
        while chunk := sock.recv(4096):  # (until the server closes: connection: close)
            answer += chunk
        answer = answer.decode()
    assert answer.startswith("HTTP/1.1 408") and "stalled for 2 s" in answer
    assert guarded.complete("Shall I", max_tokens=4).choices[0].finish_reason


def test_slow_headers_cannot_hold_the_connections(guarded):
    """A slowloris client: connections that never finish their headers are closed after
    --timeout-header; past --max-connections a new one is closed at once; a real request is
    served beside a few of them, and after the timeout beside none."""
    import socket

    host, port = guarded.url[len("http://"):].split(":")
    slow = []
    for _ in range(50):
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        slow.append(sock)
    start = time.monotonic()
    closed = 0
    for sock in slow:  # (each is closed: at once past the cap, else timed out)
        try:
            closed += sock.recv(1) == b""
        except ConnectionResetError:
            closed += 1
    assert time.monotonic() - start < 8 and closed == 50
    for sock in slow:
        sock.close()
    few = [socket.create_connection((host, int(port)), timeout=10) for _ in range(10)]
    for sock in few:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
    assert guarded.complete("Shall I", max_tokens=4).choices[0].finish_reason
    for sock in few:
        sock.close()


def test_the_http_side_awaits_the_engine(guarded):
    """With the decoding process stopped (SIGSTOP), a request that waits on it does not hold
    the others: /v1/models answers at once and /health says 503 within its 5 s; the request
    then finishes when decoding goes on."""
    got = []
    asker = threading.Thread(target=lambda: got.append(
        guarded.complete("Shall I", max_tokens=8, temperature=0)))
    os.kill(guarded.proc.pid, signal.SIGSTOP)
    try:
        asker.start()
        time.sleep(0.5)  # (its submit now waits on the stopped engine)
        start = time.monotonic()
        assert [m.id for m in guarded.client.models.list().data] == ["tiny"]
        assert time.monotonic() - start < 3
        res = httpx.get(f"{guarded.url}/health", timeout=30)
        assert res.status_code == 503 and "did not answer" in res.json()["error"]
    finally:
        os.kill(guarded.proc.pid, signal.SIGCONT)
    asker.join(timeout=60)
    assert got and got[0].choices[0].finish_reason


def test_sigterm_drains_within_its_deadline(guarded):
    """(Last on this server: it stops it.) A request longer than --shutdown-timeout is
    cancelled at the deadline; the server exits 0 and says so."""
    failed = []
    asker = threading.Thread(target=lambda: failed.append(pytest.raises(
        (openai.APIError, httpx.HTTPError), guarded.complete, "Shall I", max_tokens=100000,
        window=1, ignore_eos=True, temperature=0)))
    asker.start()
    guarded.wait_for(lambda m: m["vllm:num_requests_running"] == 1)
    start = time.monotonic()
    guarded.proc.send_signal(signal.SIGTERM)
    assert guarded.proc.wait(timeout=60) == 0, guarded.output()
    assert time.monotonic() - start < 3 + 15
    asker.join(timeout=60)
    assert failed and "timeout graceful shutdown exceeded" in guarded.output()
