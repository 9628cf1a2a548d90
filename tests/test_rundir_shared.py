"""Every DDP rank must see one run directory: two gloo ranks, each given a folder of its own (as two
nodes whose --out is local to each), both stop before training, naming the folder; given one folder,
both go on and leave nothing behind in it."""

import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, folders: list, answers):
    from lightning_lite.rundir import RunDir

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        RunDir(folders[rank], rank, ddp=True)
        answers[rank] = "ok"
    except SystemExit as e:
        answers[rank] = str(e)
    finally:
        dist.destroy_process_group()


def _run(folders: list) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    answers = mp.Manager().list(["", ""])
    mp.spawn(_rank, args=(port, folders, answers), nprocs=2)
    return list(answers)


def test_ranks_that_see_different_run_directories_stop_before_training(tmp_path):
    node0, node1 = str(tmp_path / "node0"), str(tmp_path / "node1")
    answers = _run([node0, node1])
    for answer in answers:
        assert "1 rank(s) do not see the folder rank 0 writes" in answer
        assert "same --out on a shared file system" in answer
    shared = str(tmp_path / "shared")
    assert _run([shared, shared]) == ["ok", "ok"]
    # the check's file is gone; only the run's own folders are there
    assert sorted(os.listdir(shared)) == ["calls"]
