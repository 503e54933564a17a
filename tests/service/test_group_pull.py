"""A data-parallel group's ranks share a burst: a real two-rank group of `tandem engine`."""

from support.engines import EngineProcess
from support.polling import eventually

from tandem.protocol import PRIORITY_NORMAL, WORK_GROUP


def test_a_burst_is_shared_by_the_ranks(redis_url, keys, client, tmp_path):
    # The first rank to read took all 8 (its room is max_num_seqs): the group stepped at
    # its pace, its peer running empty steps beside it.
    group = EngineProcess("normal", redis_url, keys, ["--data-parallel-size", "2"])
    group.log_dir = tmp_path
    group.start()
    stream = keys.work_stream(client.model, PRIORITY_NORMAL)
    try:
        group.wait_ready(timeout=120)
        sampling = {"max_tokens": 1000, "temperature": 0.0, "ignore_eos": True}
        for _ in range(8):
            client.submit(prompt_token_ids=[1, 2, 3], sampling=sampling)

        def held() -> list[int]:
            consumers = client.redis.xinfo_consumers(stream, WORK_GROUP)
            return sorted(c["pending"] for c in consumers)

        assert eventually(lambda: sum(held()) == 8, timeout=30), (held(), group.log())
        assert held() == [4, 4], group.log()
    finally:
        group.stop()
