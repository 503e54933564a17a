"""A data-parallel group's ranks share a burst: a real two-rank group of `tandem engine`."""

from support.polling import eventually


def test_a_burst_is_shared_by_the_ranks(start_group, client):
    # The first rank to read took all 8 (its room is max_num_seqs): the group stepped at
    # its pace, its peer running empty steps beside it.
    group = start_group()
    group.wait_ready(timeout=120)
    sampling = {"max_tokens": 1000, "temperature": 0.0, "ignore_eos": True}
    client.submit_burst(8, prompt_token_ids=[1, 2, 3], sampling=sampling)
    assert eventually(lambda: sum(client.held().values()) == 8, timeout=30), group.log()
    assert sorted(client.held().values()) == [4, 4], group.log()
