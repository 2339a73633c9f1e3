"""`relayrl view RUN_DIR`: a local web page over a run's trajectories (deploy/inspect/trajectories.py reads them).

    GET /                 the page (deploy/inspect/view_page/: plain HTML, CSS and JS; nothing fetched from elsewhere)
    GET /api/run          the run at a glance and its steps (policy versions): groups, samples, mean reward
    GET /api/groups       the groups of one version that pass the filters: ?version=&min_reward=&max_reward=
                          &status=completed,truncated&min_staleness=&max_staleness=&q=&offset=&limit=
    GET /api/timeline     the last ?steps= trainer steps across the services, from the run's spans
                          (deploy/inspect/timeline.py)

The page shows each step's prompts and completions with rewards and advantages, the tokens coloured by logprob,
weight version or loss mask, agent episodes turn by turn, two steps side by side, and a timeline of the last few
trainer steps across the services (a lane per process, the consumed samples' spans highlighted). It reads the log again as
the run appends to it, so it can watch a live run.
"""

import pathlib
import sys

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse

from deploy.inspect.timeline import timeline
from deploy.inspect.trajectories import LOG_FILE, Filters, TrajectoryStore

PAGE = pathlib.Path(__file__).with_name("view_page")
ASSETS = {"view.js": "text/javascript", "timeline.js": "text/javascript", "view.css": "text/css"}


def create_app(run_dir: str | pathlib.Path) -> FastAPI:
    store = TrajectoryStore(run_dir)
    app = FastAPI(title="relayrl view", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/")
    def page() -> FileResponse:
        return FileResponse(PAGE / "index.html", media_type="text/html")

    @app.get("/assets/{name}")
    def asset(name: str) -> FileResponse:
        if name not in ASSETS:
            raise HTTPException(404, f"no asset {name!r}")
        return FileResponse(PAGE / name, media_type=ASSETS[name])

    @app.get("/api/run")
    def run() -> dict:
        return store.summary()

    @app.get("/api/groups")
    def groups(version: int | None = None, min_reward: float | None = None, max_reward: float | None = None,
               status: str | None = None, min_staleness: int | None = None, max_staleness: int | None = None,
               q: str = "", offset: int = Query(0, ge=0), limit: int = Query(20, ge=1, le=500)) -> dict:
        statuses = frozenset(filter(None, status.split(","))) if status is not None else None
        filters = Filters(min_reward, max_reward, statuses, min_staleness, max_staleness, q.strip())
        return store.query(version, filters, offset, limit)

    @app.get("/api/timeline")
    def steps_timeline(steps: int = Query(3, ge=1, le=50)) -> dict:
        return timeline(pathlib.Path(run_dir), steps)

    return app


def main(run_dir: str, host: str = "127.0.0.1", port: int = 8600) -> int:
    import uvicorn

    folder = pathlib.Path(run_dir)
    if not folder.is_dir():
        print(f"relayrl view: {run_dir} is not a folder (a run's folder, e.g. runs/quickstart)", file=sys.stderr)
        return 2
    if not (folder / LOG_FILE).exists():
        print(f"relayrl view: {folder / LOG_FILE} does not exist (yet): the page stays empty until the run's "
              "driver writes its first sampled group (experiment file: trajectory_log)", file=sys.stderr)
    print(f"relayrl view: {folder.resolve()} at http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    uvicorn.run(create_app(folder), host=host, port=port, log_level="warning")
    return 0
