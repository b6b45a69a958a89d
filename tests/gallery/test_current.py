"""Which records are current (moelab.gallery.current): per slot the newest record of each configuration, the
fastest configuration as the row; moelab's only where it ran today's defaults; failed, before-fix, superseded,
fake-router and sweep records are history. The peers tables and issue 31's target rows are computed from them
(gallery/scripts/perf_tables.py)."""
import importlib.util
import json

from moelab.config import load_config
from moelab.gallery import default_root, load_entries, render_report
from moelab.gallery.current import AUTO_OPTIMIZER, before_fix, current_records, default_deviations
from moelab.planner.plan import resolve_loss

W = "qwen3-moe-30b-a3b-proxy"
A, B, C = "2026-11-30T10:00:00Z", "2026-12-01T10:00:00Z", "2026-12-02T10:00:00Z"


def _today_loss(gbs=2, mbs=2, fp8="off"):
    cfg = load_config(W, {"train.global_batch_size": gbs, "train.micro_batch_size": mbs, "train.compile": True,
                          "train.dtype": "bfloat16", "train.param_dtype": "bfloat16", "train.fp8": fp8})
    return resolve_loss(cfg, gpus=1, gpu_memory_gb=140.0, on_cuda=True)


TODAY = _today_loss()
OTHER = "chunked" if TODAY != "chunked" else "full"  # a loss today's default does not run


def rec(name, system="moelab", tps=1000.0, date=C, **kw):
    """A record as gpu_perf.py / the peer scripts write it (one H200, the Qwen3 proxy, seq 4096, micro batch 2)."""
    d = {"_file": f"{name}.json", "system": system, "workload": W, "gpus": 1, "gpu_name": "NVIDIA H200",
         "global_batch_size": 2, "micro_batch_size": 2, "seq_len": 4096, "dtype": "bfloat16",
         "param_dtype": "bfloat16", "router": "learned", "compile": True, "fp8": "off",
         "tokens_per_s_per_gpu": tps, "tflops_per_gpu": tps and tps / 200, "step_time_ms": 100.0,
         "peak_memory_gb": 40.0,         "commit": "ccccccc", "date": date, "device_call": "9", "command": "synthetic"}
    if system == "moelab":
        d.update(loss=TODAY, optimizer="TritonAdamW")
    d.update(kw)
    return d


def _by_file(cur):
    return {r["_file"].removesuffix(".json"): r for r in cur.best.values()}


def test_auto_optimizer_is_what_train_optimizer_auto_runs_on_cuda(monkeypatch):
    from moelab.backends import flat
    from moelab.train.optim import optimizer_kind

    monkeypatch.setattr(flat, "triton_available", lambda: True)  # torch's CUDA wheels ship Triton
    assert optimizer_kind("auto", on_cuda=True) == AUTO_OPTIMIZER


def test_before_fix_is_read_from_the_name_or_variant():
    assert before_fix({"_file": "w--moelab--cli-fp32-params-autocast-before-fix.json"})
    assert before_fix({"variant": "cli-fp32, before the autocast fix (experts fell back to the loop)"})
    assert not before_fix({"_file": "w--moelab--bf16-compile-gbs2.json", "variant": "fixed shapes"})


def test_moelab_counts_only_where_it_ran_todays_defaults():
    assert default_deviations(rec("ok")) == {}
    assert default_deviations(rec("loss", loss=OTHER)) == {"loss": (OTHER, TODAY)}
    assert default_deviations(rec("opt", optimizer="AdamW")) == {"optimizer": ("adamw", AUTO_OPTIMIZER)}
    assert default_deviations(rec("serial", optimizer_overlap=False)) == {"optimizer_overlap": ("off", "auto")}
    assert default_deviations(rec("priority", optimizer_overlap=True, overlap_priority="high")) == {
        "overlap_priority": ("high", "equal")}
    assert default_deviations(rec("equal", optimizer_overlap=True, overlap_priority="equal")) == {}
    assert default_deviations(rec("early", optimizer_overlap=True, step_before_read=True)) == {
        "update_before_read": (True, False)}
    assert default_deviations(rec("serial2", optimizer_overlap=False, step_before_read=True)) == {
        "optimizer_overlap": ("off", "auto")}  # without the overlap the update always followed the read
    assert default_deviations(rec("after", optimizer_overlap=True, step_before_read=False, norm_in_gemms=True)) == {}
    assert default_deviations(rec("pass", optimizer_overlap=True, norm_in_gemms=False)) == {
        "norm_in_gemms": (False, True)}
    assert default_deviations(rec("pageable", batch_copy="pageable")) == {"batch_copy": ("pageable", "pinned")}
    assert default_deviations(rec("pinned", batch_copy="pinned")) == {}
    assert default_deviations(rec("split", overlap_split_sms=32)) == {"overlap_split_sms": (32, 0)}
    assert default_deviations(rec("whole", overlap_split_sms=0)) == {}
    from moelab.backends.sonic import GEMMS, TILES
    table = {g: list(t) for g, t in TILES[9].items()}
    assert default_deviations(rec("table", sonic_tiles=table)) == {}  # the table itself, set by a sweep
    g = sorted(table)[0]
    other = {g: [64, 256, True, 2, 1, False]}
    ran, today = default_deviations(rec("tiles", sonic_tiles=other))["sonic_tiles"]
    assert ran == f"{g} 64x256 pingpong cluster 2x1" and today.startswith(f"{g} {table[g][0]}x{table[g][1]}")
    unnamed = next(x for x in GEMMS if x not in table)
    assert default_deviations(rec("untabled", sonic_tiles={unnamed: table[g]}))["sonic_tiles"][1] == (
        f"{unnamed} QuACK's default")
    from moelab.backends.sonic import ADD_VIA, ADDS  # gpu_perf.sh's moelab-add: the weight-gradient GEMMs' other add
    other_add = next(a for a in ADDS if a != ADD_VIA)
    assert default_deviations(rec("add", sonic_add=ADD_VIA)) == {}
    assert default_deviations(rec("other add", sonic_add=other_add, global_batch_size=16, micro_batch_size=2)) == {
        "sonic_add": (other_add, ADD_VIA)}
    assert default_deviations(rec("one micro batch", sonic_add=other_add, global_batch_size=2,
                                  micro_batch_size=2)) == {}, "a step of one micro batch never adds into .grad"
    # gpu_perf --clip: the preset's grad_clip (0 for the Qwen3 proxy) is today's; the multiply's own pass a trial
    assert default_deviations(rec("unclipped", grad_clip=0.0, clip_in_update=False)) == {}
    assert default_deviations(rec("clip", grad_clip=1.0, clip_in_update=True)) == {"grad_clip": (1.0, 0.0)}
    assert default_deviations(rec("clip pass", grad_clip=1.0, clip_in_update=False)) == {
        "grad_clip": (1.0, 0.0), "clip_in_update": (False, True)}
    if TODAY == "full":  # the compiled full loss timed beside its in-place kernel (gpu_perf's bf16-loss-compiled)
        assert default_deviations(rec("compiled loss", loss_in_place=False)) == {"loss_in_place": (False, True)}
        assert default_deviations(rec("kernel", loss_in_place=True)) == {}
    assert default_deviations(rec("chunked", loss="chunked", loss_in_place=False)).get("loss_in_place") is None
    assert set(default_deviations(rec("eager", compile=False))) >= {"compile"}
    assert "config" in default_deviations(rec("script", dtype=None, workload="not-a-preset"))
    # a record older than TritonAdamW's default, with no optimizer field, ran torch's AdamW
    assert default_deviations(rec("old", optimizer=None, date=A))["optimizer"][0] == "adamw"


def test_the_rule_keeps_the_newest_record_of_the_fastest_current_configuration():
    rs = [
        # torchtitan at global batch 2: eager (re-run: the newer replaces the older, though slower), compiled by
        # its trainer (a newer, slower re-run replaces a faster older one) and blocks (the fastest: the row)
        rec("tt-eager-a", "torchtitan", 43001.0, A, compile=False),
        rec("tt-eager-b", "torchtitan", 42002.0, B, compile=False),
        rec("tt-trainer-a", "torchtitan", 65003.0, A, compile_mode="trainer"),
        rec("tt-trainer-c", "torchtitan", 50004.0, C, compile_mode="trainer"),
        rec("tt-blocks-b", "torchtitan", 58005.0, B, compile_mode="blocks"),
        rec("tt-failed", "torchtitan", 99006.0, C, compile_mode="blocks", error="RuntimeError: x"),
        rec("tt-fp8", "torchtitan", 33007.0, B, fp8="rowwise"),  # its own slot: FP8 on
        # moelab at global batch 2: today's defaults at B (the row), an older default run (replaced), faster
        # records with another loss / torch's AdamW / a fake gate / before a fix / superseded by name
        rec("ml-default-b", tps=67008.0, date=B),
        rec("ml-default-a", tps=66009.0, date=A),
        rec("ml-other-loss", tps=75010.0, loss=OTHER),
        rec("ml-torch-adamw", tps=76011.0, optimizer="AdamW"),
        rec("ml-fake", tps=80012.0, router="fake_balanced"),
        rec("ml-before-fix", tps=90013.0),
        rec("ml-superseded", tps=91014.0, date=A),
        rec("ml-newer", tps=60015.0, date=C, global_batch_size=16, supersedes=["ml-superseded.json"]),
        rec("ml-sweep", tps=95016.0, sweep="router"),
        rec("ml-mbs4", tps=78017.0, micro_batch_size=4, global_batch_size=16,
            loss=_today_loss(16, 4)),  # its own slot: micro batch 4
    ]
    cur = current_records(rs, {})
    assert sorted(_by_file(cur)) == ["ml-default-b", "ml-mbs4", "ml-newer", "tt-blocks-b", "tt-fp8"]
    got = {r["_file"]: cur.status(r) for r in rs}
    assert got["tt-eager-a.json"].startswith("older than tt-eager-b")
    assert got["tt-trainer-a.json"].startswith("older than tt-trainer-c")  # faster, but re-run since
    assert got["tt-trainer-c.json"].startswith("slower than tt-blocks-b")
    assert got["tt-eager-b.json"].startswith("slower than tt-blocks-b")
    assert got["tt-failed.json"].startswith("failed")
    assert got["ml-default-a.json"].startswith("older than ml-default-b")
    assert got["ml-other-loss.json"] == f"not today's defaults: loss {OTHER} (today {TODAY})"
    assert got["ml-torch-adamw.json"].startswith("not today's defaults: optimizer adamw")
    assert got["ml-fake.json"].startswith("router fake_balanced")
    assert got["ml-before-fix.json"] == "measured before a fix"
    assert got["ml-superseded.json"] == "superseded by ml-newer"
    assert got["ml-sweep.json"].startswith("one run of a router sweep")
    # a newer record of the same configuration replaces the row, slower or not, whichever script wrote it
    newer = rec("ml-default-d", tps=61018.0, date="2026-12-03T00:00:00Z", backends={"experts": "grouped_mm"},
                command="moelab bench qwen3-moe-30b-a3b-proxy --set train.compile=true")
    cur = current_records(rs + [newer], {})
    assert "ml-default-d" in _by_file(cur) and "ml-default-b" not in _by_file(cur)
    # a backend set by hand is another configuration: the fastest of the two is the row
    loop = rec("ml-loop", tps=30019.0, date="2026-12-04T00:00:00Z", command="x --set backend.experts=loop")
    cur = current_records(rs + [newer, loop], {})
    assert "ml-default-d" in _by_file(cur) and cur.status(loop).startswith("slower than ml-default-d")


def test_the_gallery_peers_section_shows_the_current_rows(gallery):
    for r in (rec("tt-eager", "torchtitan", 43001.0, compile=False), rec("tt-blocks", "torchtitan", 58002.0),
              rec("ml-default", tps=67003.0), rec("ml-other-loss", tps=75004.0, loss=OTHER),
              rec("tt-16", "torchtitan", 66005.0, global_batch_size=16)):
        (gallery / "results" / r["_file"]).write_text(json.dumps({k: v for k, v in r.items() if k != "_file"}))
    peers = render_report(gallery, plots=False).split("## Peers")[1].split("## Planned")[0]
    rows = [x.split(" | ") for x in peers.splitlines() if x.startswith("| ") and not x.startswith("| system")]
    assert [(r[0].lstrip("| "), r[3], r[8]) for r in rows] == [
        ("moelab", "2", "67,003"), ("torchtitan", "2", "58,002"), ("torchtitan", "16", "66,005")]
    assert all(r[6] == "learned" for r in rows)
    assert "43,001" not in peers and "75,004" not in peers


def _perf_tables():
    spec = importlib.util.spec_from_file_location("perf_tables", default_root() / "scripts" / "perf_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PEAK = "peak memory, global batch 16, micro batch 2, `backend.loss=chunked`, bf16 <= 52 GiB"


def _targets(records):
    pt = _perf_tables()
    cur = current_records(records, {e.name: e for e in load_entries()})
    rows = [x.split(" | ") for x in pt.targets(records, cur)[2:]]
    return {r[0].lstrip("| ").split(":")[0]: (r[1], r[2], r[3].rstrip(" |")) for r in rows}


def test_issue_31_target_rows_are_computed_from_the_current_records():
    tt = [rec("tt-blocks-2", "torchtitan", 60000.0, compile_mode="blocks"),
          rec("tt-trainer-2", "torchtitan", 50000.0, compile_mode="trainer"),
          rec("tt-eager-2", "torchtitan", 70000.0, compile=False),  # faster, but eager: not the peer to beat
          rec("tt-blocks-16", "torchtitan", 64000.0, compile_mode="blocks", global_batch_size=16)]
    gbs16 = dict(global_batch_size=16, loss=_today_loss(16))
    ml = [rec("ml-2", tps=75000.0), rec("ml-2-other-loss", tps=90000.0, loss=OTHER),
          rec("ml-16", tps=76800.0, **gbs16)]
    t = _targets(tt + ml)
    assert t["bf16, global batch 2"][1:] == ("1.25x", "yes")
    assert "`ml-2` / `tt-blocks-2`" in t["bf16, global batch 2"][0]
    assert t["bf16, global batch 16"][1:] == ("1.20x", "no")
    assert t["FP8 (`train.fp8=rowwise`), global batch 16"][1:] == ("-", "not measured")
    assert t["FP8 loss parity"][2] == "not measured" and t[PEAK][2] == "not measured"
    # a newer moelab record of the same configuration replaces the row and the ratio with it
    t = _targets(tt + ml + [rec("ml-2-rerun", tps=72000.0, date="2026-12-03T00:00:00Z")])
    assert t["bf16, global batch 2"][1:] == ("1.20x", "no") and "`ml-2-rerun`" in t["bf16, global batch 2"][0]
    # FP8 against bf16 of the same commit and settings; loss parity; the chunked loss's peak memory
    fp8 = rec("ml-fp8-16", tps=96000.0, fp8="rowwise", **{**gbs16, "loss": _today_loss(16, fp8="rowwise")})
    parity = [rec(f"parity-{m}", workload=f"{W}-parity-small", variant=f"parity-fp8-{m}", fp8=m, tps=None,
                  final_loss_mean20=loss, losses=[loss] * 300) for m, loss in (("off", 2.000), ("rowwise", 2.015))]
    chunked = [rec("ml-chunked-old", peak_memory_gb=50.0, date=A, **{**gbs16, "loss": "chunked"}),
               rec("ml-chunked-new", peak_memory_gb=53.5, date=C, **{**gbs16, "loss": "chunked"})]
    t = _targets(tt + ml + [fp8] + parity + chunked)
    assert t["FP8 (`train.fp8=rowwise`), global batch 16"][1:] == ("1.25x", "yes")
    assert "`ml-fp8-16` / `ml-16`" in t["FP8 (`train.fp8=rowwise`), global batch 16"][0]
    assert t["FP8 loss parity"][1:] == ("2.0150 vs 2.0000: 0.75%", "yes")
    peak = t[PEAK]
    assert peak[1:] == ("53.5 GiB", "no") and "`ml-chunked-new`" in peak[0]


def test_a_profile_with_one_stall_is_not_the_tables_picture_of_a_step():
    pt = _perf_tables()
    base = {"workload": pt.W, "system": "moelab", "compile": True, "fp8": "off", "micro_batch_size": 2,
            "by_category_ms": {"matmul": 1.0},
            "top_kernels": [], "gpu_busy_ms": 90.0}
    calm = {**base, "_file": "calm.json", "date": "2026-12-01T00:00:00Z", "global_batch_size": 16, "step_ms": 800.0,
            "idle_ms": 30.0, "idle_gaps": {"largest": [{"ms": 1.5}]}}
    stall = {**calm, "_file": "stall.json", "date": "2026-12-02T00:00:00Z", "step_ms": 1130.0, "idle_ms": 370.0,
             "idle_gaps": {"largest": [{"ms": 342.4}]}}
    assert not pt.stalled(calm) and pt.stalled(stall)
    assert not pt.stalled({**calm, "idle_gaps": None})  # older profiles without gaps
    assert "`calm`" in "\n".join(pt.micro_batch_breakdown([calm, stall]))
    assert "`calm`" in "\n".join(pt.profiles([calm, stall]))
