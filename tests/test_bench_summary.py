"""bench/summary.py (CPU): the BENCHMARKS.md summary rows from benchmark JSON (tests/data/bench_results/), the
recorded rows they replace or keep, and the check that the committed table matches bench/results/."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "data" / "bench_results"
_spec = importlib.util.spec_from_file_location("bench_summary", ROOT / "bench" / "summary.py")
summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary)


@pytest.fixture(scope="module")
def rows():
    return {(r["case"], r["peer"]): r for r in summary.summary_rows(FIXTURE)}


def test_a_run_row_carries_its_figures_and_its_run(rows):
    row = rows[("fused_logp `logp_entropy` forward, 16384 × 151936 bf16", "liger CE")]
    assert row == {"case": "fused_logp `logp_entropy` forward, 16384 × 151936 bf16", "ours": "1.150 ms",
                   "peer": "liger CE", "peer_time": "2.300 ms", "ratio": "2.00×", "floor": "1.172 ms",
                   "ceiling": "4.25 TB/s (copy)", "date": "2026-12-08", "commit": "abc1234", "gpu": "NVIDIA H200",
                   "torch": "2.14.1+cu130", "source": "bench/results/fused.json"}


def test_the_fastest_peer_that_ran_is_the_peer(rows):
    fb = rows[("fused_logp `logp_entropy` forward+backward, 16384 × 151936 bf16", "liger CE")]
    assert (fb["ours"], fb["peer_time"], fb["ratio"], fb["floor"]) == ("3.840 ms", "10.200 ms", "2.66×", "3.516 ms")
    assert not any(peer in ("naive fp32", "compiled fp32") for _, peer in rows)
    assert not any("1024 × 151936" in case for case, _ in rows)  # the main shape only


def test_a_recorded_row_is_kept_with_its_source_until_a_run_replaces_it(rows):
    kept = rows[("example `residual_rmsnorm`, 16384 × 4096 bf16", "unfused PyTorch")]
    assert kept["source"].startswith("recorded: BENCHMARKS.md, 2026-11-29 (session 4)")
    assert kept["commit"] == "not recorded (a development run)"
    replaced = rows[("fused_logp `logp_entropy` forward, 16384 × 151936 bf16", "liger CE")]
    assert replaced["source"] == "bench/results/fused.json"
    table = summary.table(list(rows.values()))
    assert "1.148 ms" not in table and "1.150 ms" in table


def test_a_run_without_a_commit_says_not_recorded(rows):
    fwd = rows[("linear_logp `linear_logp_entropy` forward, N 8192, H 4096, V 151936",
                "Liger SM90 CuTe-DSL (bf16 entropy)")]
    assert (fwd["commit"], fwd["ours"], fwd["peer_time"], fwd["ratio"]) == ("not recorded", "14.500 ms", "16.000 ms",
                                                                            "1.10×")
    assert fwd["ceiling"] == "700 TFLOP/s (bf16 matmul)"
    fb = rows[("linear_logp `linear_logp_entropy` forward+backward, N 8192, H 4096, V 151936",
               "Liger SM90 CuTe-DSL (bf16 entropy)")]
    assert fb["peer_time"] == "63.000 ms"  # CCE's fwd+bwd did not run (None): not a peer there
    assert not any("H 2048" in case for case, _ in rows)  # no peer at that shape


def test_flash_moe_rows(rows):
    fwd = rows[("flash_moe `moe` bf16 forward, qwen3-30b-a3b", "grouped-mm expert path")]
    # floor = the row's FLOPs (500 TFLOP/s x 2.5 ms) at the run's 677 TFLOP/s
    assert (fwd["ours"], fwd["peer_time"], fwd["ratio"], fwd["floor"]) == ("2.500 ms", "7.875 ms", "3.15×", "1.846 ms")
    assert fwd["gpu"] == "NVIDIA H200"  # one GPU used, whatever the machine had (8 in the fixture's run)
    fb = rows[("flash_moe `moe` bf16 forward+backward, qwen3-30b-a3b", "grouped-mm expert path")]
    assert (fb["ratio"], fb["floor"]) == ("2.25×", "5.539 ms")
    assert not any("sonicmoe-7b" in case for case, _ in rows)  # no target: not a summary shape
    mx = rows[("flash_moe `moe(mxfp8=True)` forward, deepseek-v3", "flash_moe bf16")]
    assert (mx["ratio"], mx["floor"], mx["ceiling"]) == ("1.10×", "4.660 ms", "1239 TFLOP/s (fp8 matmul)")
    sonic = rows[("flash_moe `moe` bf16 forward+backward, mixtral", "SonicMoE")]
    assert (sonic["ours"], sonic["peer_time"], sonic["ratio"], sonic["date"]) == ("32.000 ms", "28.200 ms", "0.88×",
                                                                                 "2026-12-09")
    assert not any(case.endswith("deepseek-v3") and peer == "SonicMoE" for case, peer in rows)  # its run failed


def test_liger_moe_rows(rows):
    fb = rows[("flash_moe `moe` bf16 forward+backward, qwen3-30b-a3b", "Liger Triton fused MoE")]
    # floor: ours' forward+backward FLOPs (500 TFLOP/s x 8 ms) at the run's 700 TFLOP/s
    assert (fb["ours"], fb["peer_time"], fb["ratio"], fb["floor"]) == (
        "8.000 ms", "10.000 ms (first forward+backward 120.5 s)", "1.25×", "5.714 ms")
    assert fb["gpu"] == "NVIDIA H100 80GB HBM3"
    fwd = rows[("flash_moe `moe` bf16 forward, qwen3-30b-a3b T = 1024", "Liger Triton fused MoE")]
    assert (fwd["ratio"], fwd["floor"]) == ("1.20×", "1.905 ms")
    assert not any(case.endswith("deepseek-v3") and peer.startswith("Liger") for case, peer in rows)  # it failed
    assert not any(peer == "liger-cute-kernels MoE" for _, peer in rows)  # it did not run


def test_vocab_parallel_and_transformers_rows(rows):
    vp = rows[("vocabulary-parallel `linear_logp_entropy` forward+backward, 2 GPUs, N 8192, H 4096, V 151936",
               "the 1-GPU op on the full vocabulary")]
    assert (vp["ours"], vp["peer_time"], vp["ratio"], vp["gpu"]) == ("33.180 ms", "61.180 ms", "1.84×",
                                                                     "2 × NVIDIA H200")
    assert vp["floor"] == "27.226 ms" and vp["ceiling"] == "749 TFLOP/s (bf16 matmul), slowest rank"
    tf = rows[("flash_moe in transformers (`experts_implementation` flash_moe), Qwen3-30B-A3B experts block "
               "forward+backward, T 16384", "transformers grouped_mm")]
    assert (tf["ours"], tf["peer_time"], tf["ratio"]) == ("10.400 ms", "19.500 ms (transformers 5.24.0)", "1.88×")
    assert not any("T 4096" in case for case, _ in rows)  # no peer ran


def test_the_later_run_wins(tmp_path):
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    later = json.loads((FIXTURE / "fused.json").read_text())
    later["run"]["date"], later["results"][0]["ours_fwd_ms"] = "2026-12-10", 1.0
    (tmp_path / "a_later.json").write_text(json.dumps(later))
    rows = {(r["case"], r["peer"]): r for r in summary.summary_rows(tmp_path)}
    row = rows[("fused_logp `logp_entropy` forward, 16384 × 151936 bf16", "liger CE")]
    assert (row["ours"], row["source"]) == ("1.000 ms", "bench/results/a_later.json")


def test_a_json_without_its_run_or_a_recorded_row_without_a_field_is_refused(tmp_path):
    data = json.loads((FIXTURE / "fused.json").read_text())
    del data["run"]
    (tmp_path / "fused.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"fused.json: no \"run\" block"):
        summary.summary_rows(tmp_path)
    (tmp_path / "fused.json").unlink()
    recorded = json.loads((FIXTURE / "recorded.json").read_text())
    del recorded[0]["commit"]
    (tmp_path / "recorded.json").write_text(json.dumps(recorded))
    with pytest.raises(ValueError, match=r"lacks \['commit'\]"):
        summary.summary_rows(tmp_path)


def test_write_then_check(tmp_path, capsys):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# Benchmarks\n\n{summary.BEGIN}\nold table\n{summary.END}\n\n## flash_moe\n")
    args = ["--results", str(FIXTURE), "--benchmarks", str(doc)]
    assert summary.main(args + ["--check"]) == 1
    assert summary.main(args + ["--write"]) == 0
    text = doc.read_text()
    assert "old table" not in text and text.endswith(f"{summary.END}\n\n## flash_moe\n")
    assert "| 2.00× |" in text
    assert summary.main(args + ["--check"]) == 0


def test_benchmarks_md_matches_bench_results():
    assert summary.main(["--check"]) == 0, "BENCHMARKS.md's summary differs: python bench/summary.py --write"
