"""`kiln serve --data-parallel`'s settings, checked before Ray is started."""

from __future__ import annotations

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
