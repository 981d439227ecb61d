"""``draftctl`` command line: thin subcommands that build a job config and run it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftctl import __version__
from draftctl.config import config_from, load_config, read_settings
from draftctl.controllers import describe, expand_specs
from draftctl.errors import DraftctlError
from draftctl.jobs import DecodeJob, DemoJob, quick_demo, run_decode, run_demo
from draftctl.models import default_draft

BATCH_DTYPE_HELP = ("the target's dtype for this batch job: auto (default: its fastest batched "
                    "pass in the calibrated profile), float32 or bfloat16")


def _decode(args: argparse.Namespace) -> int:
    overrides = {k: getattr(args, k) for k in (
        "prompt", "target", "draft", "drafter", "controller", "max_new_tokens", "max_draft",
        "pass_shape", "profile", "temperature", "top_k", "top_p", "seed", "device", "dtype")}
    if args.raw:
        overrides["chat"] = False
    job = load_config(DecodeJob, args.config, overrides)
    if args.controller is None and job.draft is None and job.drafter is None \
            and default_draft(job.target) is None:
        job.controller = "none"  # no draft model at hand: plain decoding
    decoded = run_decode(job)
    s = decoded.summary()
    if args.json:
        print(json.dumps(s))
    else:
        print(decoded.text)
        print(f"\n[{s['new_tokens']} tokens in {s['wall_s']:.2f} s, {s['tokens_per_s']:.1f} tok/s, "
              f"{s['rounds']} rounds, tau {s['tau']:.2f}, controller {job.controller}; target "
              f"{s['target_dtype']} {s['pass_shape']}, draft {s['draft_dtype']}]",
              file=sys.stderr)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from draftctl.bench.report import format_table, mismatch_notice, setup_line

    job = quick_demo() if args.quick else DemoJob()
    for key in ("prompts", "draft", "drafter", "collect_per_category", "collect_max_new_tokens",
                "bench_per_category", "bench_repeats", "max_new_tokens", "device", "out"):
        if getattr(args, key) is not None:
            setattr(job, key, getattr(args, key))
    if args.kinds is not None:
        job.kinds = [kind for kind in args.kinds.split(",") if kind]
    summary = run_demo(job)
    bench = summary["bench"]
    print(f"\n{bench['target']} with draft {bench['draft']}, {bench['prompts']} test prompts, "
          f"greedy, {job.max_new_tokens} new tokens each; chosen on dev: "
          f"{', '.join(summary['dev_choices'].values())}")
    print(setup_line(bench))
    print(format_table(bench))
    print(f"\nreport: {summary['report']} (plots and answers next to it)")
    notices, failed = mismatch_notice(bench)
    for notice in notices:
        print(f"draftctl demo: {notice}", file=sys.stderr)
    return 1 if failed else 0


def _distill(args: argparse.Namespace) -> int:
    from draftctl.distill.run import DistillConfig, run_distill

    overrides = {"target": args.target, "out": args.out, "prompts": args.prompts,
                 "limit": args.limit, "steps": args.steps,
                 "time_budget_min": args.time_budget_min, "dtype": args.dtype,
                 "extra_text": args.extra_text, "kind": args.kind, "data_dir": args.data_dir,
                 "init_from": args.init_from}
    settings = read_settings(args.config, overrides)
    manifest = run_distill(config_from(DistillConfig, settings), stated=set(settings))
    print(f"draft written to {manifest['config']['out']}: eval agreement "
          f"{manifest['agreement_eval_int8']:.3f} (int8 weights as saved) after "
          f"{manifest['training']['steps']} steps")
    return 0


def _pool(args: argparse.Namespace) -> int:
    from draftctl.distill.pool import PoolConfig, run_pool

    overrides = {"target": args.target, "out": args.out, "exclude": args.exclude,
                 "seed": args.seed, "dtype": args.dtype}
    manifest = run_pool(load_config(PoolConfig, args.config, overrides))
    print(f"pool: {manifest['prompts']} prompts from {manifest['candidates']} candidates "
          f"({manifest['near_duplicates']} near duplicates, {manifest['too_close_to_excluded']}"
          f" too close to an excluded set) in {Path(manifest['config']['out']) / 'pool.jsonl'}")
    for source, n in sorted(manifest["counts"]["source"].items()):
        print(f"  {source:<14}{n:>6}")
    return 0


def _collect(args: argparse.Namespace) -> int:
    from draftctl.collect.run import CollectConfig, run_collect

    keys = ("target", "draft", "drafter", "prompts", "split", "limit", "per_category", "mode",
            "controller", "k_probe", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
            "device", "dtype", "pass_shape", "profile", "out")
    cfg = load_config(CollectConfig, args.config, {k: getattr(args, k) for k in keys})
    summary = run_collect(cfg)
    print(f"rank {summary['rank']}/{summary['world_size']}: {summary['collected']} of "
          f"{summary['prompts']} prompts collected into {summary['out']}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from draftctl.train.replay import TraceSet, replay

    traces = TraceSet(args.traces)
    results = replay(traces, expand_specs(args.controllers),
                     cost=traces.cost_model(args.profile, args.dtype, args.pass_shape))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    head = f"{'controller':<18}{'tau':>7}{'drafted':>9}{'wasted':>9}{'target fw':>11}" \
           f"{'draft fw':>10}{'speedup':>9}"
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['spec']:<18}{r['tau']:>7.2f}{r['drafted']:>9}{r['wasted']:>9.0f}"
              f"{r['target_forwards']:>11}{r['draft_forwards']:>10}{r['modelled_speedup']:>9.3f}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from draftctl.bench.report import format_table, mismatch_notice, setup_line
    from draftctl.bench.run import BenchConfig, run_bench

    keys = ("prompts", "split", "limit", "per_category", "target", "draft", "drafter",
            "pass_shape", "profile", "max_new_tokens", "max_draft", "temperature", "top_k",
            "top_p", "seed", "device", "dtype", "engine", "kernels", "repeats", "out")
    overrides = {k: getattr(args, k) for k in keys}
    if args.controllers is not None:
        overrides["controllers"] = [args.controllers]
    if args.no_plots:
        overrides["plots"] = False
    cfg = load_config(BenchConfig, args.config, overrides)
    report = run_bench(cfg)
    print(f"\n{report['target']} with draft {report['draft'] or '-'}, {report['prompts']} "
          f"{report['split']} prompts, {cfg.max_new_tokens} new tokens at most")
    print(setup_line(report))
    print(format_table(report))
    print(f"\nreport: {cfg.out}/report.md, report.json, plots and answers/")
    notices, failed = mismatch_notice(report)
    for notice in notices:
        print(f"draftctl bench: {notice}", file=sys.stderr)
    return 1 if failed else 0


def _calibrate(args: argparse.Namespace) -> int:
    from draftctl.profile import CalibrateConfig, calibrate, format_profile, sensitivity

    overrides = {k: getattr(args, k) for k in ("target", "draft", "device", "max_n", "context",
                                               "repeats", "acceptance", "out")}
    if args.dtypes:
        overrides["dtypes"] = args.dtypes.split(",")
    profile, path = calibrate(load_config(CalibrateConfig, args.config, overrides))
    if args.json:
        print(json.dumps(profile, indent=2))
        return 0
    print(format_profile(profile))
    print("\nmodelled speedup over the fastest plain decoding, by per-token acceptance:")
    for row in sensitivity(profile):
        print(f"  {row['acceptance']:.1f}: {row['speedup_vs_fastest_plain']:.2f}x with "
              f"{row['dtype']}, {row['pass_shape']}, static:{row['static_k']}")
    print(f"\nprofile: {path}")
    return 0


def _datastore(args: argparse.Namespace) -> int:
    from draftctl.models import load_tokenizer
    from draftctl.retrieval.datastore import build_datastore

    if args.action != "build":
        raise DraftctlError(f"unknown datastore action {args.action!r}: use build")
    corpus, responses = list(args.corpus or ()), list(args.responses or ())
    if "chat" in corpus:
        from draftctl.retrieval.chat import chat_responses

        corpus.remove("chat")
        responses.append(chat_responses(args.target, Path(args.out) / "chat-responses.jsonl",
                                        args.prompts, args.split))
    manifest = build_datastore(load_tokenizer(args.target), args.out, corpus, args.dataset,
                               tokenizer_spec=args.target, responses=responses)
    print(f"datastore {args.out}: {manifest['tokens']:,} tokens from {manifest['documents']:,} "
          f"documents; use it with --drafter rest:{args.out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from draftctl.train.run import TrainConfig, run_train

    cfg = load_config(TrainConfig, args.config, {"traces": args.traces, "kind": args.kind,
                                                  "out": args.out, "seed": args.seed,
                                                  "rule": args.rule, "stop": args.stop,
                                                  "ablation": args.ablation or None,
                                                  "profile": args.profile,
                                                  "dtype": args.dtype,
                                                  "pass_shape": args.pass_shape})
    report = run_train(cfg)
    s = report["summary"]
    if s is None:
        print(f"{cfg.kind}: {report['stop']} rule, threshold {report['threshold']:.4f} "
              "(chosen on dev); no test "
              f"prompts in the traces, so no test replay; model: {cfg.out}")
        return 0
    print(f"{cfg.kind}: {report['stop']} rule, threshold {report['threshold']:.4f} "
          "(chosen on dev); test replay: "
          f"{s['learned_vs_best_static']:.3f}x best static ({s['best_static']}), "
          f"{s['learned_vs_svip_tuned']:.3f}x SVIP ({s['svip_tuned_on_dev']}); "
          f"report: {cfg.out}/report.md")
    return 0


def _export(args: argparse.Namespace) -> int:
    if args.format != "onnx":
        from draftctl.export.engines import export_engine, write_engine

        result = export_engine(args.model, args.format)
        if args.out:
            write_engine(result, args.out)
        print(f"{args.format}: {result['value']:.4f}\n  {result['usage']}")
        for line in result["note"]:
            print(f"  - {line}")
        return 0
    from draftctl.export.onnx import export_onnx

    if not args.out:
        raise DraftctlError("--format onnx needs --out PATH.onnx")
    result = export_onnx(args.model, args.out)
    print(f"wrote {result['out']}: parity on {result['rows']} rows, max |p_onnx - p_native| = "
          f"{result['max_abs_diff']:.2e}")
    return 0


def _decoding_flags(parser: argparse.ArgumentParser, max_draft: bool = True,
                    dtype: bool = True) -> None:
    """The decoding options decode, collect and bench share."""
    parser.add_argument("--max-new-tokens", type=int)
    if max_draft:
        parser.add_argument("--max-draft", type=int, help="hard cap on draft tokens per round "
                                                          "(16)")
    parser.add_argument("--temperature", type=float, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--device", help="cpu, cuda or auto")
    if dtype:
        parser.add_argument("--dtype", help="auto (default: each model's calibrated dtype, "
                                            "from the profile), float32, bfloat16, ...")
    parser.add_argument("--pass-shape", help="auto (default: the profile's bit-exact shape), "
                                             "exact (row-invariant kernels, CPU), fixed:M "
                                             "(every pass padded to M rows), or the not "
                                             "bit-exact cheapest / free")
    parser.add_argument("--profile", help="a calibrated profile (default: this pair's, made by "
                                          "draftctl calibrate, or measured on first use)")


def _cost_args(parser: argparse.ArgumentParser) -> None:
    """replay's and train's --dtype and --pass-shape: time modelled for another deployment."""
    parser.add_argument("--dtype", help="model time at this target dtype's curve (default: the "
                                        "profile's choice; without --profile, the traces' "
                                        "dtype)")
    parser.add_argument("--pass-shape", help="model time at this pass shape: fixed:M, exact, "
                                             "cheapest or free (default: the profile's choice "
                                             "for the dtype); without --profile, read from the "
                                             "profile the traces were collected with")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftctl", description="Draft-length control for speculative decoding.")
    parser.add_argument("--version", action="version", version=f"draftctl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    dec = sub.add_parser(
        "decode", help="decode one prompt, plain or speculative",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="controllers (--controller SPEC):\n" + describe())
    dec.add_argument("--prompt", help="the user prompt (wrapped in the chat template)")
    dec.add_argument("--config", help="YAML file with any of these options")
    dec.add_argument("--target", help="target model: built-in name, .gguf, folder or hub id "
                                      "(default smollm2-135m-instruct)")
    dec.add_argument("--draft", help="draft model spec; must share the target's tokenizer")
    dec.add_argument("--drafter", help="model+lookup: the draft model mixed with context "
                                       "lookup; lookup: context lookup alone, no model; "
                                       "rest:DIR: a datastore (draftctl datastore build; greedy)")
    dec.add_argument("--controller", help="draft-length policy (default static:4 with a draft, "
                                          "none without)")
    _decoding_flags(dec)
    dec.add_argument("--raw", action="store_true", help="do not apply the chat template")
    dec.add_argument("--json", action="store_true", help="print one JSON object")
    dec.set_defaults(func=_decode)

    demo = sub.add_parser("demo", help="the whole toolkit on the built-in model, offline")
    demo.add_argument("--quick", action="store_true",
                      help="the same stages on 5 + 2 prompts and 24 new tokens (about 2 min)")
    demo.add_argument("--prompts", help="JSONL prompt file (default: draftctl's own set)")
    demo.add_argument("--draft", help="draft spec or folder (default: the shipped draft)")
    demo.add_argument("--drafter", help="model+lookup (default): the draft model mixed with "
                                        "context lookup; model: the draft model alone; "
                                        "model+lookup,alone=2: lookup drafts rounds alone "
                                        "where it matches (traced in probe mode)")
    demo.add_argument("--collect-per-category", type=int,
                      help="train+dev prompts per category to collect traces on (default 36)")
    demo.add_argument("--collect-max-new-tokens", type=int,
                      help="new tokens each traced prompt is followed for (default 32; the "
                           "bench decodes --max-new-tokens)")
    demo.add_argument("--kinds", help="acceptance models to train, joined by commas, among "
                                      "logreg, hgb, mlp and threshold (default hgb,mlp)")
    demo.add_argument("--bench-per-category", type=int,
                      help="test prompts per category to bench on (default 3)")
    demo.add_argument("--bench-repeats", type=int,
                      help="timed passes over each test prompt; a run's time is its fastest "
                           "pass (default 2)")
    demo.add_argument("--max-new-tokens", type=int)
    demo.add_argument("--device")
    demo.add_argument("--out", help="output folder (default runs/demo)")
    demo.set_defaults(func=_demo)

    dist = sub.add_parser("distill", help="distil a small draft model from a target")
    dist.add_argument("--config", help="YAML recipe (configs/distill*.yaml: the shipped drafts' recipes)")
    dist.add_argument("--target", help="target model spec")
    dist.add_argument("--out", help="output folder (resumes what it finds there)")
    dist.add_argument("--prompts", help="JSONL prompt file for the training text")
    dist.add_argument("--extra-text", nargs="+", metavar="FILE",
                      help="local UTF-8 text files to learn the target's labels on, too")
    dist.add_argument("--kind", choices=("model", "feature"),
                      help="model: a small independent draft (default); feature: one layer "
                           "reading the target's hidden states (needs feature_layers)")
    dist.add_argument("--data-dir", help="where responses and labels live (default OUT/data); "
                                         "another run's, to train on its data")
    dist.add_argument("--init-from", metavar="DRAFT",
                      help="continue training from this draft (a shipped name or a folder "
                           "distill wrote; same kind and target), keeping its head")
    dist.add_argument("--limit", type=int,
                      help="learn from the first N prompts only (held-out ones included)")
    dist.add_argument("--steps", type=int)
    dist.add_argument("--time-budget-min", type=float)
    dist.add_argument("--dtype", help=BATCH_DTYPE_HELP)
    dist.set_defaults(func=_distill)

    pool = sub.add_parser("pool", help="build a prompt pool a draft may learn from (self-instruct "
                                       "with the target, local text; no benchmark prompts)")
    pool.add_argument("--config", help="YAML recipe (configs/pool.yaml is the shipped one)")
    pool.add_argument("--target", help="the model that writes requests (default: built-in)")
    pool.add_argument("--exclude", nargs="+", metavar="FILE",
                      help="prompt files the pool must not share a prompt with (draftctl's own "
                           "set is always excluded)")
    pool.add_argument("--seed", type=int)
    pool.add_argument("--dtype", help=BATCH_DTYPE_HELP)
    pool.add_argument("--out", help="output folder (resumes what it finds there)")
    pool.set_defaults(func=_pool)

    col = sub.add_parser("collect", help="record per-token features and outcomes of real SD")
    col.add_argument("--config", help="YAML config (see configs/collect.yaml)")
    col.add_argument("--target")
    col.add_argument("--draft")
    col.add_argument("--drafter", help="model+lookup: the draft model mixed with context "
                                       "lookup; lookup or rest:DIR (one row per trie node): "
                                       "--mode probe or policy")
    col.add_argument("--prompts", help="JSONL prompts (turns or prompt field) or a datasets folder")
    col.add_argument("--split", help="train, dev, test, all, or several joined by commas")
    col.add_argument("--limit", type=int, help="keep the first N prompts")
    col.add_argument("--per-category", type=int, help="keep the first N prompts of each category")
    col.add_argument("--mode", choices=("probe", "policy", "dense"))
    col.add_argument("--controller", help="policy for --mode policy")
    col.add_argument("--k-probe", type=int)
    _decoding_flags(col, max_draft=False)
    col.add_argument("--out")
    col.set_defaults(func=_collect)

    rep = sub.add_parser("replay", help="evaluate controllers on traces without model calls")
    rep.add_argument("--traces", required=True, help="a folder written by draftctl collect")
    rep.add_argument("--controllers", required=True, help="comma-separated specs, e.g. "
                                                           "static:4,svip,oracle")
    rep.add_argument("--profile", help="model time with this calibrated profile's curve and "
                                       "pass shape instead of the costs recorded at collection")
    _cost_args(rep)
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(func=_replay)

    be = sub.add_parser(
        "bench", help="every controller side by side in real decoding, with AR and oracle",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="controllers (comma-separated; integer ranges expand, e.g. static:1-8):\n"
        + describe())
    be.add_argument("--config", help="YAML file with any of these options")
    be.add_argument("--prompts", help="JSONL prompts (turns or prompt field) or a datasets folder")
    be.add_argument("--split", help="train, dev, test (default), all, or several joined by commas")
    be.add_argument("--limit", type=int, help="keep the first N prompts")
    be.add_argument("--per-category", type=int, help="keep the first N prompts of each category")
    be.add_argument("--controllers", help="comma-separated specs (default: static:1-4,heuristic,"
                                          "confidence,pmin,svip,oracle)")
    be.add_argument("--target")
    be.add_argument("--draft")
    be.add_argument("--drafter", help="model+lookup, lookup or rest:DIR for every controller; "
                                      "or give one controller a drafter of its own: "
                                      "static:4@model+lookup next to model-draft controllers")
    _decoding_flags(be)
    be.add_argument("--engine", choices=("draftctl", "hf"),
                    help="draftctl (default): draftctl's decoder; hf: transformers' generate() "
                         "with AR, its own schedules (hf:constant:K, hf:heuristic[:K0], "
                         "hf:confidence[:T]) and draftctl controllers")
    be.add_argument("--kernels", choices=("stock", "packed"),
                    help="--engine hf: stock (default) or packed: every model's linear layers "
                         "on oneDNN with packed weights (CPU; passes of several tokens, which "
                         "verify drafts, cost 0.5-0.7x the stock ones on an AVX2 CPU in float32)")
    be.add_argument("--repeats", type=int,
                    help="timed passes over each prompt, each in another rotated order; a "
                         "run's time is its fastest pass (default 1)")
    be.add_argument("--no-plots", action="store_true")
    be.add_argument("--out", help="output folder (default runs/bench)")
    be.set_defaults(func=_bench)

    cal = sub.add_parser("calibrate", help="measure pass costs per dtype; choose the dtypes "
                                           "and the pass shape decoding uses")
    cal.add_argument("--config", help="YAML file with any of these options")
    cal.add_argument("--target", help="target model spec (default smollm2-135m-instruct)")
    cal.add_argument("--draft", help="draft model spec (default: the target's shipped draft; "
                                     "none: no draft)")
    cal.add_argument("--device", help="cpu, cuda or auto")
    cal.add_argument("--dtypes", help="comma-separated dtypes to measure (default: float32 and, "
                                      "where the device has it, bfloat16)")
    cal.add_argument("--max-n", type=int, help="largest pass measured, in new tokens (16)")
    cal.add_argument("--context", type=int, help="cache length the passes run at (256)")
    cal.add_argument("--repeats", type=int, help="interleaved timed repetitions (7)")
    cal.add_argument("--acceptance", type=float,
                     help="per-token acceptance the pass shape and dtype are chosen for (0.7)")
    cal.add_argument("--out", help="profile file (default: the profile cache, where decode, "
                                   "collect and bench find it)")
    cal.add_argument("--json", action="store_true", help="print the profile as JSON")
    cal.set_defaults(func=_calibrate)

    ds = sub.add_parser("datastore", help="build a REST datastore (suffix array over a corpus)")
    ds.add_argument("action", choices=("build",))
    ds.add_argument("--target", default="smollm2-135m-instruct",
                    help="model spec whose tokenizer the datastore uses")
    ds.add_argument("--corpus", nargs="*", help="files, folders (their text files), stdlib "
                                                "(the Python standard library's sources) or chat "
                                                "(the target's responses to --prompts' train "
                                                "split, generated once into OUT)")
    ds.add_argument("--prompts", help="prompt set of the chat corpus (default: draftctl's own)")
    ds.add_argument("--split", default="train", help="split of --prompts for the chat corpus")
    ds.add_argument("--responses", nargs="+", metavar="FILE",
                    help="responses JSONL files (e.g. draftctl distill's data/responses.jsonl) "
                         "added as token documents")
    ds.add_argument("--dataset", help="a saved datasets folder with a text column")
    ds.add_argument("--out", required=True, help="datastore folder")
    ds.set_defaults(func=_datastore)

    tr = sub.add_parser("train", help="fit an acceptance model and choose its stop threshold")
    tr.add_argument("--config")
    tr.add_argument("--traces", help="trace folder (collected with --split all)")
    tr.add_argument("--kind", choices=("logreg", "hgb", "mlp", "threshold"))
    tr.add_argument("--out")
    tr.add_argument("--seed", type=int)
    tr.add_argument("--rule", choices=("auto", "top_prob_1", "entropy", "svip"),
                    help="for --kind threshold: the one feature to threshold (default: auto)")
    tr.add_argument("--stop", choices=("auto", "token", "path", "cost"),
                    help="stop after a token whose own score is below the threshold (token), "
                         "once the product of the round's scores is below it (path), once "
                         "that product is below the threshold times the cost of one more "
                         "draft at this length (cost, from the calibrated cost curve), or "
                         "whichever does better on dev (auto, the default)")
    tr.add_argument("--ablation", action="store_true",
                    help="also refit without each feature group in turn (report.md lists them)")
    tr.add_argument("--profile",
                    help="model time with this calibrated profile's cost curve and pass shape "
                         "instead of the traces' own: thresholds (and the cost rule's step "
                         "costs) for another deployment, e.g. padded passes")
    _cost_args(tr)
    tr.set_defaults(func=_train)

    ex = sub.add_parser("export", help="write a trained controller as ONNX")
    ex.add_argument("--model", required=True, help="folder written by draftctl train")
    ex.add_argument("--out", help="path of the .onnx file (or of a JSON file for the engine "
                                  "formats)")
    ex.add_argument("--format", default="onnx", choices=("onnx", "hf-confidence", "llamacpp-pmin"),
                    help="onnx (default): the controller for onnx:PATH; hf-confidence / "
                         "llamacpp-pmin: the value for transformers' "
                         "assistant_confidence_threshold or llama.cpp's --draft-p-min "
                         "(threshold models on top-1 probability)")
    ex.set_defaults(func=_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DraftctlError as err:
        print(f"draftctl {args.command}: error: {err}", file=sys.stderr)
        return 2

