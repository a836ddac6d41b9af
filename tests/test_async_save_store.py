"""How the ranks of a save agree through the c10d store (``async_save.SaveAgreement``), in this
process: threads play the ranks, over a ``HashStore`` or a real ``TCPStore`` (each rank a client
of its own, as each process has)."""

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from setdiff_dist.train.async_save import SaveAgreement, SaveNotAgreed, save_name


def tcp_store():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    return server, dist.PrefixStore("default_pg", server)


@pytest.fixture(params=["hash", "tcp"])
def stores(request):
    """``client(rank)``: rank's client of one store, and the store as rank 0's process sees it
    (where no key of a save may be left)."""
    if request.param == "hash":
        store = dist.HashStore()
        yield (lambda rank: store), store
    else:
        server, store = tcp_store()
        yield (lambda rank: store.clone()), store


def play(ranks, world, client, name, act=None, timeout_s=30.0, values=None):
    """Each of ``ranks`` (threads) runs the two rounds of a save's finish: {rank: None (returned)
    or the exception it raised}; ``act`` is rank 0's ``publish``."""
    out, acted = {}, []

    def rank_main(rank):
        try:
            agree = SaveAgreement(client(rank), name, rank, world, "checkpoint step_0000006",
                                  timeout_s=timeout_s)
            agree.decide("written", None)
            value = {f"file{rank}": {"bytes": rank}} if values is None else values[rank]
            agree.decide("tables", value, act)
            # no rank returns before rank 0 has acted (latest has moved)
            assert act is None or acted or rank == 0
            out[rank] = None
        except BaseException as exc:  # noqa: BLE001
            out[rank] = exc

    if act is not None:
        inner = act

        def act(values):
            inner(values)
            acted.append(True)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


def save_keys(store):
    return [k for k in store.list_keys() if k.startswith("setdiff/save")]


def test_rank_0_acts_on_every_ranks_value_in_rank_order_and_no_key_is_left(stores):
    client, store = stores
    seen = []
    out = play(range(4), 4, client, save_name("step_0000006"), act=seen.append)
    assert out == {0: None, 1: None, 2: None, 3: None}
    assert seen == [[{f"file{r}": {"bytes": r}} for r in range(4)]]
    assert save_keys(store) == []


def test_a_save_of_the_same_tag_again_has_keys_of_its_own():
    first, again = save_name("step_0000006"), save_name("step_0000006")
    assert first != again and "step_0000006" in first and "step_0000006" in again
    # an earlier attempt's keys left in the store (its rank 1 reported, then the save failed)
    # are never taken for this one's: rank 0 waits for rank 1 of this save
    store = dist.HashStore()
    store.append(f"{first}/written/values", b"[1, null]\n")
    store.set(f"{first}/written/all", b"")
    out = play([0], 2, lambda r: store, again, timeout_s=0.3)
    assert isinstance(out[0], SaveNotAgreed) and "rank 1 of 2 never reported" in str(out[0])


def test_a_rank_that_never_reports_is_named_and_rank_0_does_not_act(stores):
    client, store = stores
    acted = []
    start = time.monotonic()
    out = play([0, 1, 3], 4, client, save_name("step_0000006"), act=acted.append,
               timeout_s=0.5)
    assert time.monotonic() - start < 10
    assert acted == []  # no manifest, latest untouched
    assert isinstance(out[0], SaveNotAgreed)
    message = str(out[0])
    assert "checkpoint step_0000006 is not complete: rank 2 of 4 never reported" in message
    assert "latest still points at the previous checkpoint" in message
    assert out[0].exit_code == 1  # (a restart may get past a dead rank)
    for rank in (1, 3):  # rank 0's word reaches the others before their own wait ends
        assert isinstance(out[rank], SaveNotAgreed), out[rank]
        assert "rank 0 could not finish it (written)" in str(out[rank])
        assert "rank 2 of 4 never reported" in str(out[rank])


def test_without_rank_0_the_others_give_up_naming_it(stores):
    client, _ = stores
    start = time.monotonic()
    out = play([1, 2], 3, client, save_name("step_0000006"), timeout_s=0.3)
    assert time.monotonic() - start < 10
    for rank in (1, 2):
        assert isinstance(out[rank], SaveNotAgreed), out[rank]
        assert "rank 0 never answered (written)" in str(out[rank])
        assert out[rank].every_rank is False  # (rank 0 cannot say it: each rank does)


def test_rank_0s_failure_reaches_every_rank_and_no_key_is_left(stores):
    client, store = stores

    def publish(tables):
        raise OSError(28, "No space left on device")

    out = play(range(3), 3, client, save_name("step_0000006"), act=publish)
    assert isinstance(out[0], OSError)  # (its own error: save_failed explains it)
    for rank in (1, 2):
        assert isinstance(out[rank], SaveNotAgreed), out[rank]
        assert "rank 0 could not finish it (tables): OSError" in str(out[rank])
        assert out[rank].every_rank  # (rank 0 says it, once)
    assert save_keys(store) == []


def test_a_rank_waiting_on_its_own_client_leaves_the_shared_one_free():
    """Every TCPStore operation holds its client's lock, a wait for as long as it waits: a
    rank's agreement waits on a client of its own, so the training thread (and NCCL) keep the
    process's default client."""
    server, default = tcp_store()
    # a world of one on this store: the default group's store is the one the save clones
    dist.init_process_group("gloo", store=default, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=123))
    try:
        from setdiff_dist.train.async_save import process_group_timeout, store_client

        assert process_group_timeout() == 123
        ours = dist.distributed_c10d._get_default_store()
        client = store_client()
        assert client is not ours
        agree = SaveAgreement(client, save_name("step_0000001"), 1, 2, "checkpoint", 2.0)
        waiting = threading.Thread(target=lambda: pytest.raises(SaveNotAgreed, agree.decide,
                                                                "written", None))
        waiting.start()
        time.sleep(0.3)
        start = time.monotonic()
        ours.set("training-thread", b"1")
        assert ours.get("training-thread") == b"1"
        assert time.monotonic() - start < 0.5
        waiting.join(30)
        assert not waiting.is_alive()
        # the default client sees what the agreement's client wrote (one store)
        assert any(k.endswith("/written/count") for k in ours.list_keys())
    finally:
        dist.destroy_process_group()


def test_when_rank_0s_store_goes_away_the_others_say_so_in_one_line():
    """The store's server lives in rank 0's process: when rank 0 ends in the middle of a save
    (its own write failed), a waiting rank raises SaveNotAgreed (one line, no traceback), not
    torch's network error."""
    import gc

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, 1, False,
                           timeout=datetime.timedelta(seconds=30))
    agree = SaveAgreement(dist.PrefixStore("default_pg", client), save_name("step_0000007"), 1,
                          2, "checkpoint step_0000007", timeout_s=20)
    out = {}

    def rank_1():
        try:
            agree.decide("written", None)
        except BaseException as exc:  # noqa: BLE001
            out["error"] = exc

    thread = threading.Thread(target=rank_1)
    thread.start()
    time.sleep(0.5)
    del server  # (rank 0's process ends: its store's server with it)
    gc.collect()
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(out.get("error"), SaveNotAgreed), out
    assert "served by rank 0) went away during the save (written" in str(out["error"])
    assert not out["error"].every_rank
