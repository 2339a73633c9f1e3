"""The `relayrl` command. Parses arguments before any heavy import, then calls one function."""

import argparse
import importlib
import signal
import sys
from importlib.metadata import PackageNotFoundError, version

from services.teardown import skip_final_collection

# name -> module exposing `Config` (pydantic, with a `server` field) and `async serve(config)`.
SERVICES = {
    "rollout": "rollout.main",
    "reward": "reward.service",
    "buffer": "services.buffer.service",
    "prefill": "rollout.pd.prefill",  # prefill/decode disaggregation workers (rollout/pd/prefill.py)
    "decode": "rollout.pd.decode",
}


def _version() -> str:
    try:
        return version("relayrl")
    except PackageNotFoundError:
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relayrl",
        description="Asynchronous RL post-training for LLMs as independent gRPC services.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("version", help="print the relayrl version")

    serve = sub.add_parser("serve", help="run one service (rollout, reward, buffer; prefill and decode workers) until SIGTERM")
    serve.add_argument("service", choices=sorted(SERVICES))
    serve.add_argument("--config", help="YAML config file")
    serve.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field, e.g. --set server.address=0.0.0.0:50051 (repeatable)")
    serve.add_argument("--model", help="model folder (shortcut for --set model=PATH; rollout)")
    serve.add_argument("--address", help="host:port (shortcut for --set server.address=...)")
    serve.add_argument("--insecure", action="store_true",
                       help="allow a non-loopback address with auth off (server.insecure=true)")

    health = sub.add_parser("health", help="standard gRPC health check of a running service")
    health.add_argument("address", help="HOST:PORT")
    health.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds")
    health.add_argument("--token", help="bearer token")
    health.add_argument("--ca-cert", help="CA PEM to verify the server (TLS)")

    status = sub.add_parser("status", help="one table of every service of a run: health, weight version, queue, "
                            "staleness, throughput, errors")
    status.add_argument("sources", nargs="+", metavar="RUN_DIR | ADDRESS",
                        help="a run folder (its services.json) or service addresses HOST:PORT[/METRICS_PORT]")
    status.add_argument("--watch", action="store_true", help="refresh live until Ctrl-C")
    status.add_argument("--json", action="store_true", help="one JSON object (per refresh with --watch)")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between polls (rates need two)")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
    status.add_argument("--token", help="bearer token (default, for a RUN_DIR: as the run reached each service)")
    status.add_argument("--ca-cert", help="CA PEM to verify the servers (TLS; default, for a RUN_DIR: the run's)")

    run = sub.add_parser("run", help="an experiment file (your model, data and reward: deploy/experiment/schema.py); "
                         "without one, the quickstart: its project written into runs/quickstart-project, then its "
                         "experiment file run (SFT warm-up, then async GRPO on one machine)")
    run.add_argument("experiment", nargs="?", help="EXPERIMENT.yaml (deploy/experiment/schema.py documents every field); "
                     "none = the quickstart's (deploy/experiment/quickstart_experiment.yaml)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    run.add_argument("--ray", metavar="ADDRESS", help="with an experiment file (or --resume of its run): place "
                     "each service on its node group of the Ray cluster at ADDRESS (a group's name is the Ray "
                     "resource marking its nodes; deploy/cluster/ray_launcher.py)")
    run.add_argument("--resume", metavar="RUN_DIR", help="go on with the run in RUN_DIR where it stopped (its "
                     "recorded config; buffer, trainer checkpoint, driver position, RL clock and curve carry on)")

    doctor = sub.add_parser("doctor", help="an experiment file before a run (config, model and tokenizer, data "
                            "fields, reward, ports, disk, versions), a sweep file (its fields, its experiment), "
                            "or a run folder after it: the known faults "
                            "(restart loops, out of memory, collective timeouts, weights not reaching the rollout, "
                            "zero or constant rewards, entropy collapse, data wait, mismatch spikes) with their "
                            "evidence and fix; exit 1 on any error")
    doctor.add_argument("experiment", metavar="EXPERIMENT.yaml | SWEEP.yaml | RUN_DIR",
                        help="an experiment file, a sweep file, or a finished or failed run's folder (runs/quickstart, "
                        "...); any other YAML file is named as what it is")
    doctor.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the experiment (or sweep) file")

    view = sub.add_parser("view", help="a local web page over a run's trajectories (RUN_DIR/trajectories.jsonl): "
                          "prompts, completions, rewards, advantages, tokens by logprob, version or loss mask, "
                          "agent episodes turn by turn, filters and search, two steps side by side")
    view.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (runs/quickstart, ...)")
    view.add_argument("--port", type=int, default=8600, help="HTTP port (default 8600)")
    view.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                      "only; another address shows the run to whoever reaches it)")
    trace = sub.add_parser("trace", help="a window of a run's spans (RUN_DIR/traces, docs/observability.md) as a "
                           "Chrome / Perfetto trace JSON that opens offline")
    trace.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (runs/quickstart, ...)")
    trace.add_argument("--out", help="the trace file to write (default RUN_DIR/trace.json)")
    trace.add_argument("--start", type=float, default=None, metavar="SECONDS",
                       help="the window starts this long after the run's first span (default: the run's last --seconds)")
    trace.add_argument("--seconds", type=float, default=60.0, help="the window's length (default 60)")
    profile = sub.add_parser("profile", help="a torch.profiler capture of a live run's next trainer steps, written "
                             "into RUN_DIR/profiles (docs/observability.md)")
    profile.add_argument("run_dir", metavar="RUN_DIR", help="the live run's folder (runs/quickstart, ...)")
    profile.add_argument("--steps", type=int, default=2, help="how many steps to capture (default 2)")
    profile.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the trace (default 300)")
    sweep = sub.add_parser("sweep", help="hyper-parameter search over an experiment file with Optuna (deploy/sweep/study.py): "
                           "TPE, pruning on the held-out curve, each trial an ordinary run in SWEEP_DIR/trial-N, a "
                           "results table and plots; running it again resumes it")
    sweep.add_argument("sweep", help="SWEEP.yaml (deploy/sweep/config.py documents every field)")
    sweep.add_argument("--resume", action="store_true", help="go on with the study in the sweep's folder (an error "
                       "if there is none; without the flag a study there is resumed too, and a new one started "
                       "otherwise)")
    sweep.add_argument("--ray", metavar="ADDRESS", help="each trial places its services on the Ray cluster at "
                       "ADDRESS (deploy/cluster/ray_launcher.py); the sweep file's `parallel` trials side by side")

    deploy = sub.add_parser("deploy", help="an experiment file on node groups: check its placement, render it for "
                            "Kubernetes; scale a live local run's rollout replicas")
    targets = deploy.add_subparsers(dest="target", required=True, metavar="TARGET")
    check = targets.add_parser("check", help="validate the file and print each service's group, replicas, nodes, "
                               "resources and ports as a table; exit 2 naming the problem")
    k8s = targets.add_parser("k8s", help="render Kubernetes manifests (deploy/cluster/k8s.py): a workload and a headless "
                             "Service per service, the trainer as an indexed Job under torchrun, a ConfigMap, Secrets")
    k8s.add_argument("--out", help="write one YAML file per object into this folder (else all to stdout)")
    scale = targets.add_parser("scale", help="change how many replicas of a service a live local run has "
                               "(deploy/local/scale.py): new rollout replicas get the current weights before traffic, "
                               "removed ones drain first")
    scale.add_argument("service", choices=["rollout"])
    scale.add_argument("replicas", type=int, help="replicas wanted")
    scale.add_argument("--run", required=True, metavar="RUN_DIR", help="the run's folder (runs/quickstart, ...)")
    scale.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the run's answer")
    for target in (check, k8s):
        target.add_argument("experiment", help="EXPERIMENT.yaml")
        target.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                            help="override a config field")
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from services.config import ConfigError, load_config
    from services.server import InsecureAddress, check_exposure

    module = importlib.import_module(SERVICES[args.service])
    overrides = list(args.set)
    if args.model:
        overrides.append(f"model={args.model}")
    if args.address:
        overrides.append(f"server.address={args.address}")
    if args.insecure:
        overrides.append("server.insecure=true")
    try:
        config = load_config(module.Config, args.config, overrides)
        check_exposure(config.server.address, config.server)
    except (ConfigError, InsecureAddress) as exc:
        print(f"relayrl serve {args.service}: {exc}", file=sys.stderr)
        return 2
    asyncio.run(module.serve(config))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.client import connect_sync
    from services.config import ClientConfig

    channel = connect_sync(args.address, ClientConfig(token=args.token, ca_cert=args.ca_cert))
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_status(args: argparse.Namespace) -> int:
    from deploy.inspect.status_table import status
    from services.config import ClientConfig

    try:
        return status(args.sources, watch=args.watch, as_json=args.json, interval=args.interval,
                      timeout=args.timeout, client=ClientConfig(token=args.token, ca_cert=args.ca_cert)
                      if args.token or args.ca_cert else None)
    except FileNotFoundError as exc:
        print(f"relayrl status: {exc.filename} not found: the run records no services (yet)", file=sys.stderr)
        return 2


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the job's finally blocks, which stop its processes


def cmd_run(args: argparse.Namespace) -> int:
    # Python's default SIGTERM ends the process at once, leaving the services and trainer it started running.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run(args)
    except KeyboardInterrupt:  # raised after the job's finally blocks stopped every process it started
        print("relayrl run: interrupted; every process it started is stopped", file=sys.stderr)
        return 128 + signal.SIGINT


def _run(args: argparse.Namespace) -> int:
    if args.ray and not (args.experiment or args.resume):
        print("relayrl run: --ray runs an experiment file, or resumes the run of one (not the quickstart)",
              file=sys.stderr)
        return 2
    if args.resume:
        if args.experiment or args.set:
            print("relayrl run: --resume goes on with the run's recorded config: give no experiment file or --set "
                  "with it", file=sys.stderr)
            return 2
        from deploy.runs.resume import main as resume

        return resume(args.resume, ray_address=args.ray)
    if args.experiment:
        from deploy.runs.experiment_run import main as run_experiment

        return run_experiment(args.experiment, args.set, ray_address=args.ray)
    # The quickstart: the shipped experiment file, on the project it writes first.
    from deploy.runs.experiment_run import run_quickstart as quickstart

    return quickstart(args.set)


def cmd_doctor(args: argparse.Namespace) -> int:
    import pathlib

    if pathlib.Path(args.experiment).is_dir():
        if args.set:
            print("relayrl doctor: --set overrides an experiment file, not a run folder", file=sys.stderr)
            return 2
        from deploy.inspect.diagnose import main as diagnose_run

        return diagnose_run(args.experiment)
    from deploy.inspect.doctor import main as doctor

    return doctor(args.experiment, args.set)


def cmd_view(args: argparse.Namespace) -> int:
    from deploy.inspect.view import main as view

    return view(args.run_dir, args.host, args.port)


def cmd_trace(args: argparse.Namespace) -> int:
    from deploy.inspect.chrome_trace import main as trace

    return trace(args.run_dir, args.out, args.start, args.seconds)


def cmd_profile(args: argparse.Namespace) -> int:
    from deploy.inspect.profile_request import main as profile

    return profile(args.run_dir, args.steps, args.timeout)


def cmd_sweep(args: argparse.Namespace) -> int:
    from deploy.sweep.study import main as sweep

    return sweep(args.sweep, resume=args.resume, ray_address=args.ray)


def cmd_deploy(args: argparse.Namespace) -> int:
    if args.target == "scale":
        from deploy.local.scale import main as scale

        return scale(args.service, args.replicas, args.run, args.timeout)
    if args.target == "check":
        from deploy.inspect.placement_table import main as check

        return check(args.experiment, args.set)
    from deploy.cluster.k8s import main as k8s

    return k8s(args.experiment, args.set, args.out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "version":
        print(f"relayrl {_version()}")
        return 0
    commands = {"serve": cmd_serve, "health": cmd_health, "status": cmd_status, "run": cmd_run, "doctor": cmd_doctor,
                "view": cmd_view, "trace": cmd_trace, "profile": cmd_profile, "sweep": cmd_sweep, "deploy": cmd_deploy}
    try:
        return commands[args.command](args)
    finally:
        skip_final_collection()


if __name__ == "__main__":
    sys.exit(main())
