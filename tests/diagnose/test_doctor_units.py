"""Doctor checks without workers: a small /sys tree, real sockets, the example NCCL logs."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tandem.core.errors import DataError
from tandem.diagnose import nccl_log, network, system
from tandem.diagnose.checks import FAIL, INFO, PASS, WARN, Check
from tandem.diagnose.doctor_worker import check_skew, collapse, compare_versions, judge_busbw

DATA = Path(__file__).parent / "data"


def _sys_tree(root: Path) -> Path:
    """/sys/class with eth0 (up, 25 Gb/s), ib0, lo and one HCA mlx5_0 with port 1 ACTIVE."""
    for name, state, speed in (("eth0", "up", "25000"), ("ib0", "up", "200000"), ("lo", "unknown", None)):
        d = root / "net" / name
        d.mkdir(parents=True)
        (d / "operstate").write_text(state + "\n")
        (d / "mtu").write_text("1500\n")
        if speed:
            (d / "speed").write_text(speed + "\n")
    port = root / "infiniband" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (port / "link_layer").write_text("InfiniBand\n")
    return root


def test_interfaces_and_rdma_from_sys(tmp_path):
    sc = _sys_tree(tmp_path)
    ifaces = network.interfaces(sc)
    assert [(i.name, i.state, i.speed_mbps) for i in ifaces] == [("eth0", "up", 25000), ("ib0", "up", 200000),
                                                                 ("lo", "unknown", None)]
    r = network.rdma(sc)
    assert r.devices == ["mlx5_0"] and r.ports[0].link_layer == "InfiniBand"
    assert network.check_rdma(r).status == PASS
    assert network.check_rdma(network.rdma(tmp_path / "none")).status == INFO
    assert network.check_interfaces(ifaces).status == PASS
    assert "25 Gb/s" in network.check_interfaces(ifaces).detail


@pytest.mark.parametrize("var,value,status", [
    ("NCCL_SOCKET_IFNAME", "eth", PASS), ("NCCL_SOCKET_IFNAME", "=eth0", PASS),
    ("NCCL_SOCKET_IFNAME", "=eth", FAIL), ("NCCL_SOCKET_IFNAME", "ens", FAIL),
    ("NCCL_SOCKET_IFNAME", "^lo,docker", PASS), ("NCCL_SOCKET_IFNAME", "^eth,ib,lo", FAIL),
    ("GLOO_SOCKET_IFNAME", "eth0", PASS), ("GLOO_SOCKET_IFNAME", "eth", FAIL),
    ("GLOO_SOCKET_IFNAME", None, INFO)])
def test_interface_variables(tmp_path, var, value, status):
    c = network.check_ifname_var(var, value, network.interfaces(_sys_tree(tmp_path)))
    assert c.status == status
    if status == FAIL:
        assert "eth0" in c.fix or "exclude" in c.fix


@pytest.mark.parametrize("value,status", [("mlx5_0", PASS), ("mlx5_0:1", PASS), ("mlx5", PASS),
                                          ("=mlx5", FAIL), ("mlx5_0:2", FAIL), ("mlx5_3", FAIL),
                                          (None, INFO)])
def test_ib_hca(tmp_path, value, status):
    assert network.check_ib_hca(value, network.rdma(_sys_tree(tmp_path))).status == status


def test_ib_hca_without_devices(tmp_path):
    c = network.check_ib_hca("mlx5_0", network.rdma(tmp_path))
    assert c.status == FAIL and "no RDMA devices" in c.detail


def test_master_port_listening_and_closed():
    ifaces = network.interfaces()
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        checks = {c.name: c for c in network.check_master("127.0.0.1", port, ifaces)}
        assert checks["master port"].status == PASS and checks["route to master"].detail.startswith("via lo")
    # Same port, now closed: before a job that is normal, under the launcher it is a failure.
    assert network.check_master("127.0.0.1", port, ifaces)[-1].status == INFO
    assert network.check_master("127.0.0.1", port, ifaces, expect_listener=True)[-1].status == FAIL


def test_system_checks(tmp_path):
    assert system.check_shm(str(tmp_path)).status in (PASS, WARN)
    assert system.check_shm(str(tmp_path / "missing")).status == FAIL
    assert system.check_nofile(minimum=1).status == PASS
    c = system.check_nofile(minimum=10 ** 12)
    assert c.status == WARN and "ulimit -n" in c.fix
    assert system.check_disk(tmp_path / "not" / "made" / "yet").status in (PASS, WARN)
    assert system.check_gpus("cpu", 2).status == INFO
    assert "torch" in system.versions()


def test_a_warn_needs_a_fix():
    with pytest.raises(ValueError):
        Check("x", WARN, "detail")


def test_versions_and_skew():
    same = {"0:a": {"torch": "2.13.0"}, "1:b": {"torch": "2.13.0"}}
    assert compare_versions(same).status == PASS
    diff = compare_versions({"0:a": {"torch": "2.13.0", "nccl": "2.21"}, "1:b": {"torch": "2.13.0", "nccl": "2.18"}})
    assert diff.status == FAIL and "nccl: 0:a=2.21, 1:b=2.18" in diff.detail
    names = ["0:a", "1:b"]
    assert check_skew([0.0, 0.002], 0.001, names).status == PASS
    assert check_skew([0.0, -0.5], 0.001, names).status == WARN
    bad = check_skew([0.0, 45.0], 0.001, names)
    assert bad.status == FAIL and "1:b" in bad.detail and "chrony" in bad.fix


def _statuses(name: str) -> dict[str, str]:
    return {c.name: c.status for c in nccl_log.judge(nccl_log.read(DATA / name))}


def test_nccl_log_two_nodes_ib():
    s = nccl_log.read(DATA / "two_nodes_ib.log")
    assert s.version == "2.21.5+cuda12.4" and s.network == "IB" and s.hosts == ["gpu-a01", "gpu-a02"]
    assert s.ib_devices == ["mlx5_0:1", "mlx5_1:1"] and s.nranks == 4 and s.init_complete == 4
    assert s.rings == 4 and s.trees == 4 and s.channels == 4
    assert s.peers[(1, 2)] == "NET/IB" and s.peers[(0, 1)] == "P2P" and s.peers[(2, 3)] == "P2P"
    st = _statuses("two_nodes_ib.log")
    assert st["inter-node transport"] == PASS and FAIL not in st.values() and WARN not in st.values()


def test_nccl_log_socket_despite_ib_fails():
    st = _statuses("socket_despite_ib.log")
    assert st["socket despite InfiniBand"] == FAIL and st["NCCL_IB_DISABLE"] == WARN
    assert nccl_log.read(DATA / "socket_despite_ib.log").transports == {"NET/Socket": 4}


def test_nccl_log_hung_init():
    s = nccl_log.read(DATA / "hung_init.log")
    assert s.ib_absent and s.init_complete == 0 and len(s.warnings) == 1 and s.peers == {(0, 1): "SHM"}
    st = _statuses("hung_init.log")
    assert st["init"] == WARN and st["nccl warnings"] == WARN and st["NCCL_P2P_DISABLE"] == WARN
    assert st["channels"] == WARN and st["socket transport"] == WARN
    # The local machine's RDMA devices turn a socket transport into a failure.
    local = {c.name: c.status for c in nccl_log.judge(s, local_ib_devices=["mlx5_0"])}
    assert local["socket despite InfiniBand"] == FAIL


def test_nccl_log_bad_input(tmp_path):
    with pytest.raises(DataError, match="cannot read"):
        nccl_log.read(tmp_path / "missing.log")
    (tmp_path / "x.log").write_text("hello\nworld\n")
    with pytest.raises(DataError, match="no NCCL lines"):
        nccl_log.read(tmp_path / "x.log")


def test_doctor_cli_nccl_log_json_and_exit(tmp_path):
    from tandem.diagnose.checks import ChecksFailed
    from tandem.cli.doctor import nccl_log_report

    nccl_log_report(DATA / "two_nodes_ib.log", tmp_path / "ok.json")
    doc = json.loads((tmp_path / "ok.json").read_text())
    assert doc["status"] == PASS and doc["nccl_log"]["peers"]["1->2"] == "NET/IB"
    with pytest.raises(ChecksFailed) as e:
        nccl_log_report(DATA / "socket_despite_ib.log", tmp_path / "bad.json")
    assert e.value.exit_code == 1 and json.loads((tmp_path / "bad.json").read_text())["status"] == FAIL


def test_identical_node_rows_fold_and_differences_stay():
    rows = [Check("/dev/shm", PASS, "16 GiB", node="0:a"), Check("/dev/shm", WARN, "64 MiB", fix="f", node="1:b"),
            Check("open files", PASS, "65536", node="0:a"), Check("open files", PASS, "65536", node="1:b")]
    out = [(c.node, c.name, c.status) for c in collapse(rows, 2)]
    assert out == [("0:a", "/dev/shm", PASS), ("1:b", "/dev/shm", WARN), ("all", "open files", PASS)]


def test_quick_all_reduce_judgement(tmp_path):
    assert judge_busbw(10.0, 8 << 20, 4, 0.0, 12.0).status == PASS
    low = judge_busbw(4.0, 8 << 20, 4, 0.0, 12.0)
    assert low.status == WARN and "under half" in low.detail and "NCCL_DEBUG" in low.fix
    assert judge_busbw(4.0, 8 << 20, 4, 0.0, 0.0).status == INFO
    assert judge_busbw(10.0, 8 << 20, 4, 2.0, 12.0).status == FAIL
    # The expectation can come from a calibration file: its link bandwidth, in GB/s.
    from tandem.diagnose.doctor import expected_busbw

    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"links": {"intra_node": {"bandwidth_Bps": 2e9}, "inter_node": {"bandwidth_Bps": 5e8}}}))
    assert expected_busbw(0.0, cal, 1) == 2.0 and expected_busbw(0.0, cal, 2) == 0.5
    assert expected_busbw(3.0, cal, 2) == 3.0
    from tandem.core.errors import ConfigError

    with pytest.raises(ConfigError, match="calibration"):
        expected_busbw(0.0, tmp_path / "missing.json", 1)
