"""setdiff-serve, talked to with the real OpenAI client on 127.0.0.1: greedy completions equal
setdiff-generate's whatever else is in the batch, streams add up to the completion, bad requests
get OpenAI's 400 body, a full queue 429, a client that leaves frees its row, SIGTERM drains, and
TP=2 under torchrun answers as TP=1. Pure logic (rows joining and leaving the batch) is checked
in this process."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

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
        """The Prometheus samples without labels, and ``requests_<outcome>``."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith("#"):
                continue
            name, value = line.rsplit(" ", 1)
            if name.startswith("setdiff_requests_total{"):
                name = "requests_" + name.split('"')[1]
            out[name] = float(value)
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


@pytest.fixture(scope="module")
def server(set_run, tmp_path_factory):
    s = Server(set_run, tmp_path_factory.mktemp("serve"), "--max-batch-size", "16")
    yield s
    s.close()


@pytest.fixture(scope="module")
def small(trained, tmp_path_factory):
    """A causal checkpoint (BPE) behind one row and a queue of one: the limits."""
    s = Server(trained("order.kind=causal", tokenizer="bpe:300"),
               tmp_path_factory.mktemp("small"), "--max-batch-size", "1", "--max-queue", "1")
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
    server.wait_for(lambda m: m["setdiff_batch_size"] >= 4)
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
    for prompt, settings in (("Shall I compare thee", GREEDY), ("Rough winds", SAMPLED)):
        whole = server.complete(prompt, **settings).choices[0].text
        chunks = list(server.complete(prompt, stream=True, stream_options={
            "include_usage": True}, **settings))
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(texts) == whole and len(texts) > 2
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")
        assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
        assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices


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
    cases = [(dict(bogus=1), "unknown field 'bogus'"),
             (dict(temperature=5), "temperature"), (dict(top_p=0), "top_p"),
             (dict(max_tokens=0), "max_tokens"), (dict(window=0), "window"),
             (dict(n=2), "n"), (dict(threshold=-1), "threshold"),
             (dict(prompt="x" * 40), "context of 32 tokens")]
    for fields, said in cases:
        body = {"model": "tiny", "prompt": "Shall I", **fields}
        res = httpx.post(url, json=body, timeout=30)
        assert res.status_code == 400, (fields, res.text)
        assert said in res.json()["error"]["message"], (fields, res.text)
    with pytest.raises(openai.BadRequestError, match="unknown field"):
        server.complete("Shall I", extra_body={"frequency_bogus": 2})
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.completions.create(model="gpt-4", prompt="Shall I")
    after = server.metrics()
    assert after["requests_bad_request"] - before["requests_bad_request"] == len(cases) + 3
    assert after["requests_completed"] == before["requests_completed"]
    assert server.complete("Shall I", **GREEDY).choices[0].text  # (still serving)


def test_models_health_and_metrics(server):
    models = server.client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].max_model_len == 32
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    m = server.metrics()
    for name in ("setdiff_generation_tokens_total", "setdiff_prompt_tokens_total",
                 "setdiff_tokens_per_step_count", "setdiff_queue_depth", "setdiff_batch_size",
                 "setdiff_request_latency_seconds_count",
                 "setdiff_time_to_first_token_seconds_count", "setdiff_step_seconds_count"):
        assert name in m, name
    assert m["setdiff_generation_tokens_total"] > 0 and m["requests_completed"] > 0


def _long(small, **kw):
    """A request that holds the one row for a while (thousands of causal steps)."""
    return small.complete("Shall I", max_tokens=4000, ignore_eos=True, temperature=0, **kw)


def test_a_full_queue_answers_429_and_a_client_that_leaves_frees_its_row(small):
    base = small.metrics()
    stream = _long(small, stream=True)
    next(iter(stream))  # it runs
    small.wait_for(lambda m: m["setdiff_batch_size"] == 1)
    queued = {}
    waiter = threading.Thread(target=lambda: queued.setdefault(
        "r", small.complete("Shall I", max_tokens=5, temperature=0)))
    waiter.start()
    small.wait_for(lambda m: m["setdiff_queue_depth"] == 1)
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
                   and m["setdiff_batch_size"] == 0, timeout=30)


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
    small.wait_for(lambda m: m["setdiff_batch_size"] == 1)
    threads[1].start()  # ... and this one waits (a queue of one)
    small.wait_for(lambda m: m["setdiff_batch_size"] == 1 and m["setdiff_queue_depth"] == 1)
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
    from setdiff_dist.serve.batch import ContinuousBatch, Spec, TextStream

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
            for row in batch.admit(joins.pop(step, [])):
                streams[row.spec.id] = TextStream(tok)
                streamed[row.spec.id] = ""
            rows = list(batch.rows)
            for row in batch.step():
                got[row.spec.id] = row
            for row in rows:
                streamed[row.spec.id] += streams[row.spec.id].delta(row)
                s = row.sample
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
    two = Server(set_run, tmp_path, "--max-batch-size", "8", tp=2)
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
        # a rank that dies mid-request: the request fails at once with the reason (it does
        # not hang), and rank 0 exits 1 so that the job ends and can be restarted
        rank1 = [int(p) for p in subprocess.run(["pgrep", "-P", str(two.proc.pid)],
                                                capture_output=True, text=True).stdout.split()
                 if "RANK=1" in open(f"/proc/{p}/environ").read().split("\0")]
        failed = []
        asker = threading.Thread(target=lambda: failed.append(pytest.raises(
            openai.APIStatusError, _long, two).value))
        asker.start()
        two.wait_for(lambda m: m["setdiff_batch_size"] == 1)
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
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{s.url}/health", timeout=5)
    finally:
        s.close()
