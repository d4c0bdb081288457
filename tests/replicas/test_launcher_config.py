"""`kiln serve --data-parallel`'s settings, checked before Ray is started."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kiln.cli.main import build_parser
from kiln.server.replicas.launcher import DataParallelConfig


def test_fixed_replicas_and_autoscaling_bounds_become_rays_settings():
    assert DataParallelConfig(replicas=3).scaling() == {"num_replicas": 3}
    scaled = DataParallelConfig(replicas=2, min_replicas=1, max_replicas=4, target_ongoing_requests=8).scaling()
    assert scaled == {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                             "target_ongoing_requests": 8}}
    assert DataParallelConfig(replicas=2, replica_cpus=1.5).cpus_per_replica() == 1.5
    assert DataParallelConfig(replicas=2, replica_gpus=1).cpus_per_replica() == 0.0


@pytest.mark.parametrize("low,high,start", [(2, 4, 1), (1, 2, 3), (0, 2, 1)])
def test_bounds_that_do_not_hold_the_start_are_refused(low, high, start):
    with pytest.raises(ValueError, match="replica counts"):
        DataParallelConfig(replicas=start, min_replicas=low, max_replicas=high)


def test_the_command_line_reads_the_bounds(capsys):
    parser = build_parser()
    args = parser.parse_args(["serve", "--data-parallel", "2", "--autoscale", "1:4", "--routing", "round_robin"])
    assert args.data_parallel == 2 and args.autoscale == (1, 4) and args.routing == "round_robin"
    for bad in ("4:1", "x", "0:2"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--autoscale", bad])
        assert "--autoscale" in capsys.readouterr().err


@pytest.mark.e2e
def test_a_port_in_use_is_said_before_ray_starts(tiny_artifacts):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "kiln.cli.main", "serve", "--artifacts", str(tiny_artifacts),
                               "--data-parallel", "2", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and f"127.0.0.1:{port} is already in use" in done.stderr
    assert "Started a local Ray instance" not in done.stderr


def test_each_replica_pins_its_task_workers_to_cores_of_its_own(monkeypatch):
    from kiln.server.replicas import deployments

    monkeypatch.setattr(deployments.os, "cpu_count", lambda: 4)
    flag = deployments.task_topology_flag
    assert [flag(1, rank) for rank in range(2)] == ["--task_topology_cpu_ids=0", "--task_topology_cpu_ids=1"]
    assert flag(2, 1) == "--task_topology_cpu_ids=2,3" and flag(2, 2) == "--task_topology_cpu_ids=0,1"
    assert flag(2, None) == "--task_topology_max_group_count=2"  # no rank known: IREE chooses


def test_the_routers_record_of_a_replica_is_bounded_like_its_cache():
    from kiln.runtime.config import ModelParams, PagedKVCacheParams
    from kiln.runtime.service_config import ServiceConfig
    from kiln.server.replicas.launcher import replica_pages

    params = ModelParams(max_seq_len=256, transformer_block_count=2, attn_head_dim=8, prefill_batch_sizes=[1],
                         decode_batch_sizes=[1], paged_kv_cache=PagedKVCacheParams(16, 4, 64, "float32"))
    page_bytes = params.page_elems * 4
    assert replica_pages(ServiceConfig(), params) == 64  # the export's device_block_count
    assert replica_pages(ServiceConfig(page_count=40), params) == 40
    assert replica_pages(ServiceConfig(page_count=40, host_kv_bytes=100 * page_bytes + 1), params) == 140
