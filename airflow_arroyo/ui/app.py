"""The FastAPI app behind the Airflow plugin, mounted by Airflow's api-server at ``/arroyo``.

HTML pages (server-rendered, no JavaScript, charts as inline SVG):

* ``/``                                     pipelines: state, health, Spark app, last completed epoch
* ``/pipelines/{pipeline_id}``              a pipeline and a page of its checkpoint history, with a chart;
                                            its supervision and restarts when a supervisor ran it; the
                                            physical plan its run recorded (queries, remaining channels)
* ``/pipelines/{pipeline_id}/epochs/{n}``   one epoch: per-stage timeline, stages not acknowledged yet
* ``/pipelines/{pipeline_id}/retention``    cleanup runs and the cleanup lock
* ``/pipelines/{pipeline_id}/epochs/{n}/provenance``
                                            what a completed epoch read (per source, its input range), its
                                            snapshot's objects, and what each sink committed for it
* ``/pipelines/{pipeline_id}/provenance``   which epoch wrote this: a file sink's file (``?file=``) or a table's
                                            version (``?sink=&table_version=``)

JSON API (same data): ``/api/pipelines``, ``/api/pipelines/{id}``, ``/api/pipelines/{id}/epochs``,
``/api/pipelines/{id}/epochs/{n}``, ``/api/pipelines/{id}/retention``, ``/api/pipelines/{id}/epochs/{n}/provenance``,
``/api/pipelines/{id}/provenance``.

Provenance is read by :mod:`airflow_arroyo.core.provenance` (the CLI's code) through the reader's read-only connections
(:attr:`StoreReader.records`), and from the pipeline's snapshot objects in its storage: the api-server needs read
access to that storage (the same credentials as the driver's, e.g. S3's in its environment).

The one write: a person's verdict on a commit gate (:func:`airflow_arroyo.core.gates.record_verdict`), as JSON
(``POST /api/pipelines/{id}/gates/{sink}/{epoch}/verdict``) or from the pipeline page's Approve and Reject
buttons (an HTML form posting to the same path without ``/api``). It needs more than reading: Airflow's own
permission to answer a human-in-the-loop task (``requires_access_dag("PUT", DagAccessEntity.HITL_DETAIL)``), and
the verdict is recorded under the authenticated user's name, never one from the request. Neither can be sent by
another site: the JSON route takes ``application/json`` only (a cross-site form cannot send it), the form route
only a same-origin browser request (``Sec-Fetch-Site``, else ``Origin``).

Airflow does not put its authentication in front of plugin apps: every route here depends on
``requires_access_view(AccessView.PLUGINS)`` (a valid Airflow JWT as ``Authorization: Bearer`` or
the ``_token`` cookie the Airflow UI sets, and the auth manager's permission to view plugins). The
OpenAPI/docs routes are turned off. Responses carry a strict Content-Security-Policy that still lets
the Airflow UI frame the pages (``frame-ancestors 'self'``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, is_dataclass
from datetime import datetime, timedelta
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

from fastapi import Depends, FastAPI, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_arroyo.core.epochs import EpochState, validate_pipeline_id
from airflow_arroyo.core.exceptions import (
    ArroyoError,
    ConfigurationError,
    NotFoundError,
    StateConflictError,
    StoreError,
    UnknownEpochError,
    UnknownPipelineError,
)
from airflow_arroyo.core.gates import GATE_TRANSITIONS, GateRecord, GateState, record_verdict
from airflow_arroyo.core.provenance import EpochProvenance, epoch_of_file, epoch_of_table_version, epoch_provenance
from airflow_arroyo.core.supervision import restart_due, strategy_text
from airflow_arroyo.store.reads import EpochDetail, PipelineOverview, StoreReader
from airflow_arroyo.store.records import EpochRecord, SinkCommitRecord
from airflow_arroyo.ui import charts, format
from airflow_arroyo.ui.health import Finding, HealthThresholds, assess, worst
from airflow_arroyo.ui.plan_view import plan_view
from airflow_arroyo.ui.store_source import StoreSource
from airflow_arroyo.ui.timeline import stage_timings

__all__ = ["create_app"]

log = logging.getLogger(__name__)

#: Seconds between reloads of a page that shows an epoch in flight (a <meta> refresh: no JavaScript).
REFRESH_S = 5

CSP = ("default-src 'none'; style-src 'self'; img-src 'self' data:; frame-ancestors 'self'; "
       "base-uri 'none'; form-action 'self'")


class StoreUnavailable(Exception):
    """The epoch store is not configured or cannot be reached (HTTP 503)."""


def _templates() -> Environment:
    env = Environment(
        loader=PackageLoader("airflow_arroyo.ui", "templates"),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update({
        "bytes": format.bytes_human,
        "dur": format.duration_human,
        "ts": format.timestamp,
        "ranges": format.epoch_ranges,
        "urlpart": lambda s: quote(str(s), safe=""),
    })
    env.globals.update({"age": format.age, "state_colours": charts.STATE_COLOURS, "policy_text": format.policy_text})
    return env


def _safe_http_url(url: str | None) -> str | None:
    """Only http(s) links from the store become links (a ``javascript:`` URL stays text)."""
    if url and url.lower().startswith(("http://", "https://")):
        return url
    return None


def _duration_s(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return (end - start).total_seconds()


def _epoch_notes(e: EpochRecord) -> list[str]:
    notes = []
    if e.pin_label is not None:
        notes.append(f"pinned: {e.pin_label}")
    if e.is_final:
        notes.append("final epoch")
    if e.failure_reason:
        notes.append(e.failure_reason)
    if e.pruned_at is not None:
        notes.append(f"pruned {format.timestamp(e.pruned_at)}, freed {format.bytes_human(e.bytes_freed)}")
    return notes


def _not_restorable(e: EpochRecord) -> str:
    """Why an epoch cannot be restored (the epoch page says it instead of a restore hint)."""
    if e.state is EpochState.SUPERSEDED:
        return "a later run restored an older epoch, which cut the channels before this one"
    if e.state in (EpochState.PRUNED, EpochState.PRUNING):
        return "retention pruned it (its snapshot objects are deleted)"
    if e.state in (EpochState.FAILED, EpochState.EXPIRED):
        return f"it {e.state.value} (only completed epochs are consistent snapshots)"
    return f"it is {e.state.value}"


def _headline(text: str) -> str:
    """The first line of a restart's cause (the page shows the rest when it is opened)."""
    lines = text.strip().splitlines()
    return lines[0].strip() if lines else ""


def _json(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    return jsonable_encoder(value)


def _overview_json(o: PipelineOverview, findings: list[Finding]) -> dict[str, Any]:
    return {
        "pipeline": _json(o.pipeline),
        "now": o.now,
        "last_completed_epoch": _json(o.last_completed) if o.last_completed else None,
        "last_completed_age_s": o.last_completed_age_s,
        "in_flight_epoch": _json(o.in_flight) if o.in_flight else None,
        "consecutive_failures": o.consecutive_failures,
        "cleanup_lock": _json(o.cleanup_lock) if o.cleanup_lock else None,
        "health": worst(findings).label,
        "warnings": [{"kind": f.kind, "severity": f.severity.label, "message": f.message} for f in findings],
    }


def _base(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def _wants_json(request: Request) -> bool:
    path = request.url.path
    return f"{_base(request)}/api/" in path or path.startswith("/api/")


def _pipeline_id_ok(pipeline_id: str) -> str:
    try:
        return validate_pipeline_id(pipeline_id)
    except ConfigurationError as exc:
        raise UnknownPipelineError(pipeline_id) from exc


def _page_url(request: Request, path: str, **params: Any) -> str:
    kept = {k: v for k, v in params.items() if v is not None}
    return f"{_base(request)}{path}" + (f"?{urlencode(kept)}" if kept else "")


class VerdictBody(BaseModel):
    """``POST .../verdict``: pass or fail, and why. Who gives it is the signed-in user (a ``by`` is refused)."""

    model_config = ConfigDict(extra="forbid")

    passed: StrictBool
    reason: str | None = Field(None, max_length=4000)


def _gate_actions(state: GateState) -> tuple[bool, bool]:
    """Whether a gate in ``state`` may still be approved, rejected (the buttons the page shows)."""
    moves = GATE_TRANSITIONS[state]
    return GateState.PASSED in moves, GateState.FAILED in moves


def _same_origin(request: Request) -> bool:
    """A browser's own form post: ``Sec-Fetch-Site: same-origin``, or, from a browser without it, an ``Origin``
    that is this server's. Anything else (another site, or no evidence at all) is refused."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site == "same-origin"
    origin = request.headers.get("origin")
    return origin is not None and origin == f"{request.url.scheme}://{request.url.netloc}"


@dataclass(frozen=True)
class _Ui:
    """What the routes share: the read-only queries, the templates, the health thresholds."""

    src: StoreSource
    templates: Environment
    thresholds: HealthThresholds

    def render(self, request: Request, name: str, http_status: int = 200, **context: Any) -> HTMLResponse:
        context.setdefault("now", None)
        html = self.templates.get_template(name).render(base=_base(request), request=request, **context)
        return HTMLResponse(html, status_code=http_status)

    def queries(self) -> StoreReader:
        try:
            return self.src.get()
        except ConfigurationError as exc:
            raise StoreUnavailable(str(exc)) from exc

    def verdict(self, pipeline_id: str, sink: str, epoch: int, *, passed: bool, by: str,
                reason: str | None) -> GateRecord:
        """Record a person's verdict through the one use case (the CLI and the operators call it too)."""
        try:
            store = self.src.writer()
        except ConfigurationError as exc:
            raise StoreUnavailable(str(exc)) from exc
        return record_verdict(store, pipeline_id, sink, epoch, passed=passed, by=by, reason=reason or None)

    def error(self, request: Request, status_code: int, message: str) -> Response:
        if _wants_json(request):
            return JSONResponse({"detail": message}, status_code=status_code)
        return self.render(request, "error.html", http_status=status_code, title=f"Error {status_code}",
                           status_code=status_code, message=message)


def create_app(source: StoreSource | None = None, *,
               thresholds: HealthThresholds = HealthThresholds()) -> FastAPI:
    """Build the app. ``source`` gives the read-only queries (default: the ``arroyo_default`` connection)."""
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
    from airflow.api_fastapi.core_api.security import requires_access_view

    src = source if source is not None else StoreSource()
    ui = _Ui(src, _templates(), thresholds)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        src.close()

    app = FastAPI(
        title="Arroyo checkpoints",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        dependencies=[Depends(requires_access_view(AccessView.PLUGINS))],
        lifespan=lifespan,
    )
    app.state.arroyo_source = src

    @app.middleware("http")
    async def security_headers(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        response.headers.setdefault("Content-Security-Policy", CSP)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    _add_error_handlers(app, ui)
    _add_pages(app, ui)
    _add_api(app, ui)
    _add_verdicts(app, ui)
    _add_provenance(app, ui)
    _add_shadows(app, ui)
    return app


def _add_error_handlers(app: FastAPI, ui: _Ui) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 401 and not _wants_json(request):
            login_url = None
            try:
                from airflow.api_fastapi.app import get_auth_manager

                login_url = get_auth_manager().get_url_login(next_url=str(request.url))
            except RuntimeError:
                login_url = None
            return ui.render(request, "signin.html", http_status=401, title="Sign in", login_url=login_url,
                          detail=str(exc.detail))
        if _wants_json(request):
            return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
        return ui.render(request, "error.html", http_status=exc.status_code, title=f"Error {exc.status_code}",
                      status_code=exc.status_code, message=str(exc.detail))

    @app.exception_handler(UnknownPipelineError)
    async def unknown_pipeline(request: Request, exc: UnknownPipelineError) -> Response:
        return ui.error(request, 404, f"no pipeline named {exc.pipeline_id!r} in the epoch store")

    @app.exception_handler(UnknownEpochError)
    async def unknown_epoch(request: Request, exc: UnknownEpochError) -> Response:
        return ui.error(request, 404, str(exc))

    @app.exception_handler(NotFoundError)
    async def not_found(request: Request, exc: NotFoundError) -> Response:
        return ui.error(request, 404, str(exc))  # e.g. no gate of that sink for that epoch

    @app.exception_handler(StateConflictError)
    async def state_conflict(request: Request, exc: StateConflictError) -> Response:
        return ui.error(request, 409, str(exc))  # e.g. a verdict on a gate already committed: nothing changed

    @app.exception_handler(StoreUnavailable)
    async def store_unavailable(request: Request, exc: StoreUnavailable) -> Response:
        return ui.error(request, 503, str(exc))

    @app.exception_handler(StoreError)
    async def store_error(request: Request, exc: StoreError) -> Response:
        log.warning("Arroyo UI: epoch store error: %s", exc)
        return ui.error(request, 503, f"the epoch store could not be read: {exc}")

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> Response:
        details = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors())
        return ui.error(request, 422, f"invalid request: {details}")


def _add_pages(app: FastAPI, ui: _Ui) -> None:
    @app.get("/static/arroyo.css", include_in_schema=False)
    def stylesheet() -> Response:
        css = resources.files("airflow_arroyo.ui").joinpath("static/arroyo.css").read_text(encoding="utf-8")
        return Response(css, media_type="text/css", headers={"Cache-Control": "private, max-age=300"})

    @app.get("/", response_class=HTMLResponse, name="pipelines_page")
    def pipelines_page(request: Request, after: str | None = Query(None, max_length=200),
                       limit: int = Query(50, ge=1, le=200)) -> HTMLResponse:
        page = ui.queries().pipelines(after=after, limit=limit)
        rows = [(o, assess(o, ui.thresholds)) for o in page.items]
        live = any(o.in_flight is not None for o in page.items)
        return ui.render(request, "pipelines.html", title="Pipelines", page=page, rows=rows, now=page.now,
                      refresh_s=REFRESH_S if live else None,
                      worst=worst, safe_url=_safe_http_url,
                      next_url=_page_url(request, "/", after=page.next_after, limit=limit) if page.next_after
                      else None,
                      first_url=_page_url(request, "/", limit=limit) if after else None)

    @app.get("/pipelines/{pipeline_id}", response_class=HTMLResponse, name="pipeline_page")
    def pipeline_page(request: Request, pipeline_id: str, before: int | None = Query(None, ge=1),
                      after: int | None = Query(None, ge=0), limit: int = Query(100, ge=1, le=500)) -> HTMLResponse:
        pid = _pipeline_id_ok(pipeline_id)
        page = ui.queries().pipeline_page(pid, before=before, after=after, limit=limit)
        o = page.overview
        findings = assess(o, ui.thresholds)
        path = f"/pipelines/{quote(pid, safe='')}"
        return ui.render(
            request, "pipeline.html", title=pid, o=o, p=o.pipeline, findings=findings, health=worst(findings),
            epochs=page.epochs, now=o.now, spark_url=_safe_http_url(o.pipeline.spark_ui_url),
            chart=charts.history_chart(page.epochs.epochs, o.now), duration=_duration_s,
            older_url=_page_url(request, path, before=page.epochs.older_before, limit=limit)
            if page.epochs.older_before else None,
            newer_url=_page_url(request, path, after=page.epochs.newer_after, limit=limit)
            if page.epochs.newer_after is not None else None,
            newest_url=_page_url(request, path, limit=limit) if (before or after is not None) else None,
            in_flight_state=EpochState.TRIGGERED, notes=_epoch_notes, summary=page.summary, forks=page.forks,
            restarts=page.restarts, more_restarts=page.more_restarts,
            restart_due=restart_due(o.pipeline, page.restarts), headline=_headline,
            restart_at=lambda r: r.failed_at + timedelta(seconds=r.delay_s),
            strategy=strategy_text(o.pipeline.restart_strategy) if o.pipeline.restart_strategy else None,
            plan=plan_view(o.pipeline.config), gates=page.gates, gate_actions=_gate_actions,
            # the newest page follows an epoch in flight; a page of older history stays still
            refresh_s=REFRESH_S if o.in_flight is not None and before is None and after is None else None,
        )

    @app.get("/pipelines/{pipeline_id}/epochs/{epoch}", response_class=HTMLResponse, name="epoch_page")
    def epoch_page(request: Request, pipeline_id: str, epoch: int) -> HTMLResponse:
        pid = _pipeline_id_ok(pipeline_id)
        detail = ui.queries().epoch_detail(pid, epoch)
        return ui.render(request, "epoch.html", title=f"{pid} · epoch {epoch}", **_epoch_context(detail))

    @app.get("/pipelines/{pipeline_id}/retention", response_class=HTMLResponse, name="retention_page")
    def retention_page(request: Request, pipeline_id: str, before_id: int | None = Query(None, ge=1),
                       limit: int = Query(50, ge=1, le=200)) -> HTMLResponse:
        pid = _pipeline_id_ok(pipeline_id)
        page = ui.queries().retention(pid, before_id=before_id, limit=limit)
        path = f"/pipelines/{quote(pid, safe='')}/retention"
        return ui.render(request, "retention.html", title=f"{pid} · retention", page=page, p=page.pipeline,
                      now=page.now, duration=_duration_s,
                      older_url=_page_url(request, path, before_id=page.next_before_id, limit=limit)
                      if page.next_before_id else None,
                      newest_url=_page_url(request, path, limit=limit) if before_id else None)


def _epoch_context(detail: EpochDetail) -> dict[str, Any]:
    e = detail.epoch
    timings = stage_timings(detail)
    end_s = _duration_s(e.triggered_at, e.ended_at)
    return {
        "d": detail, "e": e, "p": detail.pipeline, "now": detail.now, "timings": timings,
        "duration_s": end_s if end_s is not None else (
            (detail.now - e.triggered_at).total_seconds() if e.state is EpochState.TRIGGERED else None),
        "chart": charts.timeline_chart(timings, epoch_end_s=end_s,
                                       # how it ended: a pruned epoch's page says when it was pruned
                                       epoch_end_label=f"{(e.outcome or e.state).value} after "
                                                       f"{format.duration_human(end_s)}"
                                       if end_s is not None else ""),
        "in_flight": e.state is EpochState.TRIGGERED,
        "refresh_s": REFRESH_S if e.state is EpochState.TRIGGERED else None,
        "restorable": e.state is EpochState.COMPLETED,
        "not_restorable": _not_restorable(e),
        "prev_epoch": e.epoch - 1 if e.epoch > 1 else None,
        "next_epoch": e.epoch + 1 if e.epoch < detail.pipeline.last_epoch else None,
    }


def _add_api(app: FastAPI, ui: _Ui) -> None:
    @app.get("/api/pipelines")
    def api_pipelines(after: str | None = Query(None, max_length=200),
                      limit: int = Query(50, ge=1, le=200)) -> dict[str, Any]:
        page = ui.queries().pipelines(after=after, limit=limit)
        return {"now": page.now, "next_after": page.next_after,
                "pipelines": [_overview_json(o, assess(o, ui.thresholds)) for o in page.items]}

    @app.get("/api/pipelines/{pipeline_id}")
    def api_pipeline(pipeline_id: str) -> dict[str, Any]:
        o = ui.queries().overview(_pipeline_id_ok(pipeline_id))
        return _overview_json(o, assess(o, ui.thresholds))

    @app.get("/api/pipelines/{pipeline_id}/epochs")
    def api_epochs(pipeline_id: str, before: int | None = Query(None, ge=1), after: int | None = Query(None, ge=0),
                   limit: int = Query(100, ge=1, le=500)) -> dict[str, Any]:
        page = ui.queries().epochs(_pipeline_id_ok(pipeline_id), before=before, after=after, limit=limit)
        return {
            "epochs": [{**_json(e), "duration_s": e.duration_s} for e in page.epochs],
            "older_before": page.older_before,
            "newer_after": page.newer_after,
        }

    @app.get("/api/pipelines/{pipeline_id}/epochs/{epoch}")
    def api_epoch(pipeline_id: str, epoch: int) -> dict[str, Any]:
        detail = ui.queries().epoch_detail(_pipeline_id_ok(pipeline_id), epoch)
        return {
            "now": detail.now,
            "epoch": {**_json(detail.epoch), "duration_s": detail.epoch.duration_s},
            "acks": [_json(a) for a in detail.acks],
            "pending_stages": detail.pending_stages,
            "stages": [
                {**_json(t), "segments": [{"part": n, "start_s": s, "length_s": ln} for n, s, ln in t.segments]}
                for t in stage_timings(detail)
            ],
        }

    @app.get("/api/pipelines/{pipeline_id}/retention")
    def api_retention(pipeline_id: str, before_id: int | None = Query(None, ge=1),
                      limit: int = Query(50, ge=1, le=200)) -> dict[str, Any]:
        page = ui.queries().retention(_pipeline_id_ok(pipeline_id), before_id=before_id, limit=limit)
        return {
            "now": page.now,
            "cleanup_lock": {**_json(page.lock), "live": page.lock_live} if page.lock else None,
            "cleanup_runs": [_json(r) for r in page.runs],
            "next_before_id": page.next_before_id,
        }


def _add_verdicts(app: FastAPI, ui: _Ui) -> None:
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import get_user, requires_access_dag

    # Airflow's permission to answer a human-in-the-loop task: more than the plugin view every route needs
    may_decide = [Depends(requires_access_dag(method="PUT", access_entity=DagAccessEntity.HITL_DETAIL))]

    @app.post("/api/pipelines/{pipeline_id}/gates/{sink}/{epoch}/verdict", dependencies=may_decide)
    def api_verdict(request: Request, pipeline_id: str, sink: str, epoch: int, body: VerdictBody,
                    user: Any = Depends(get_user)) -> dict[str, Any]:
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            # a cross-site form cannot send JSON; refusing anything else keeps cookie-borne requests honest
            raise StarletteHTTPException(415, "send the verdict as application/json: {\"passed\": true, "
                                              "\"reason\": \"...\"}")
        gate = ui.verdict(_pipeline_id_ok(pipeline_id), sink, epoch, passed=body.passed, by=user.get_name(),
                          reason=body.reason)
        log.info("Arroyo UI: %s recorded %s on the gate of sink %s for epoch %s of pipeline %s", user.get_name(),
                 gate.state, sink, epoch, pipeline_id)
        return {"gate": _json(gate)}

    @app.post("/pipelines/{pipeline_id}/gates/{sink}/{epoch}/verdict", dependencies=may_decide,
              include_in_schema=False)
    async def form_verdict(request: Request, pipeline_id: str, sink: str, epoch: int,
                           user: Any = Depends(get_user)) -> Response:
        if not _same_origin(request):
            return ui.error(request, 403, "a verdict from this form must come from the Arroyo page itself (the "
                                          "browser did not say it did); scripts use the JSON API: POST "
                                          f"{_base(request)}/api/pipelines/<id>/gates/<sink>/<epoch>/verdict")
        form = parse_qs((await request.body()).decode("utf-8", "replace"), max_num_fields=10)
        verdict = (form.get("verdict") or [""])[0]
        reason = (form.get("reason") or [""])[0].strip()
        if verdict not in ("pass", "fail"):
            return ui.error(request, 422, "the form's verdict must be 'pass' (Approve) or 'fail' (Reject)")
        if len(reason) > 4000:
            return ui.error(request, 422, f"the reason is {len(reason)} characters long; at most 4000")
        pid = _pipeline_id_ok(pipeline_id)
        gate = await run_in_threadpool(ui.verdict, pid, sink, epoch, passed=verdict == "pass", by=user.get_name(),
                                       reason=reason or None)
        log.info("Arroyo UI: %s recorded %s on the gate of sink %s for epoch %s of pipeline %s", user.get_name(),
                 gate.state, sink, epoch, pipeline_id)
        # back to the page (a GET: reloading it does not post again)
        return RedirectResponse(f"{_base(request)}/pipelines/{quote(pid, safe='')}#gates", status_code=303)


#: file names a provenance page lists per sink (the JSON API gives them all)
FILES_SHOWN = 200


def _provenance(ui: _Ui, pipeline_id: str, epoch: int) -> EpochProvenance:
    try:
        return epoch_provenance(ui.queries().records, pipeline_id, epoch)
    except ConfigurationError as exc:  # not completed, pruned, no storage registered: the message says what to ask
        raise StarletteHTTPException(409, str(exc)) from exc
    except OSError as exc:
        raise StoreUnavailable(f"the snapshot objects of pipeline {pipeline_id!r} could not be read from its "
                               f"storage: {exc}; the api-server needs read access to it") from exc


def _which_epoch(ui: _Ui, pipeline_id: str, file: str | None, sink: str | None,
                 table_version: int | None) -> SinkCommitRecord | None:
    """The commit that made ``file`` (or ``table_version`` of ``sink``) visible; None when nothing was asked.
    Raises ConfigurationError for a question that cannot be answered as asked, NotFoundError when no epoch did."""
    if file:
        if sink or table_version is not None:
            raise ConfigurationError("ask about a file (file=...) or a table version (sink=...&table_version=...), "
                                     "not both")
        return epoch_of_file(ui.queries().records, pipeline_id, file)
    if sink and table_version is not None:
        return epoch_of_table_version(ui.queries().records, pipeline_id, sink, table_version)
    if sink or table_version is not None:
        raise ConfigurationError("a table version needs its sink: give both sink=... and table_version=...")
    return None


def _sink_dsn(target: Mapping[str, Any]) -> str:
    """A PostgreSQL shadow target's database as the api-server reaches it: the sink's Airflow connection
    (``conn_id``, wherever Airflow keeps it), else its ``dsn_env`` in the api-server's environment. The compare
    reads it in a READ ONLY transaction."""
    from airflow_arroyo.core.shadow import sink_dsn

    if not target.get("conn_id"):
        return sink_dsn(target)
    from airflow.exceptions import AirflowNotFoundException

    from airflow_arroyo.hooks.arroyo import ArroyoHook

    try:
        return ArroyoHook(str(target["conn_id"]), migrate=False).get_dsn()
    except AirflowNotFoundException as exc:
        raise ConfigurationError(f"the PostgreSQL sink on {target.get('live')!r} names Airflow connection "
                                 f"{target['conn_id']!r}, which the api-server does not have; create it there") from exc


def _shadows(ui: _Ui, pid: str) -> list[dict[str, Any]]:
    """The shadow runs of ``pid``, each with its comparison (or why there is none), read-only."""
    from airflow_arroyo.core.shadow import compare_shadow

    records = ui.queries().records
    out: list[dict[str, Any]] = []
    for shadow in records.shadows_of(pid):
        entry: dict[str, Any] = {"shadow": _json(shadow), "compare": None, "error": None}
        if shadow.state == "active":
            try:
                entry["compare"] = compare_shadow(records, shadow.shadow_id,  # type: ignore[arg-type]
                                                  pg_dsn=_sink_dsn)
            except (ArroyoError, OSError) as exc:
                entry["error"] = str(exc)
        out.append(entry)
    return out


def _add_shadows(app: FastAPI, ui: _Ui) -> None:
    @app.get("/pipelines/{pipeline_id}/shadows", response_class=HTMLResponse, name="shadows_page")
    def shadows_page(request: Request, pipeline_id: str) -> HTMLResponse:
        pid = _pipeline_id_ok(pipeline_id)
        ui.queries().overview(pid)  # an unknown pipeline is a 404
        return ui.render(request, "shadows.html", title=f"{pid} · shadow runs", pid=pid, shadows=_shadows(ui, pid))

    @app.get("/api/pipelines/{pipeline_id}/shadows")
    def api_shadows(pipeline_id: str) -> list[dict[str, Any]]:
        pid = _pipeline_id_ok(pipeline_id)
        ui.queries().overview(pid)
        return _shadows(ui, pid)


def _add_provenance(app: FastAPI, ui: _Ui) -> None:
    @app.get("/pipelines/{pipeline_id}/epochs/{epoch}/provenance", response_class=HTMLResponse,
             name="provenance_page")
    def provenance_page(request: Request, pipeline_id: str, epoch: int) -> HTMLResponse:
        pid = _pipeline_id_ok(pipeline_id)
        prov = _provenance(ui, pid, epoch)
        return ui.render(request, "provenance.html", title=f"{pid} · epoch {epoch} · provenance", prov=prov,
                         pid=pid, files_shown=FILES_SHOWN, offsets=format.offsets)

    @app.get("/pipelines/{pipeline_id}/provenance", response_class=HTMLResponse, name="lookup_page")
    def lookup_page(request: Request, pipeline_id: str, file: str | None = Query(None, max_length=4096),
                    sink: str | None = Query(None, max_length=200),
                    table_version: int | None = Query(None, ge=0)) -> HTMLResponse:
        pid = _pipeline_id_ok(pipeline_id)
        ui.queries().overview(pid)  # an unknown pipeline is a 404, not an empty answer
        commit, message, code = None, None, 200
        try:
            commit = _which_epoch(ui, pid, file, sink, table_version)
        except NotFoundError as exc:
            message, code = str(exc), 404
        except ConfigurationError as exc:
            message, code = str(exc), 422
        return ui.render(request, "provenance_lookup.html", http_status=code, title=f"{pid} · which epoch wrote this",
                         pid=pid, commit=commit, message=message, file=file or "", sink=sink or "",
                         table_version="" if table_version is None else table_version)

    @app.get("/api/pipelines/{pipeline_id}/epochs/{epoch}/provenance")
    def api_provenance(pipeline_id: str, epoch: int) -> dict[str, Any]:
        return _provenance(ui, _pipeline_id_ok(pipeline_id), epoch).as_dict()

    @app.get("/api/pipelines/{pipeline_id}/provenance")
    def api_lookup(pipeline_id: str, file: str | None = Query(None, max_length=4096),
                   sink: str | None = Query(None, max_length=200),
                   table_version: int | None = Query(None, ge=0)) -> dict[str, Any]:
        pid = _pipeline_id_ok(pipeline_id)
        try:
            commit = _which_epoch(ui, pid, file, sink, table_version)
        except ConfigurationError as exc:  # a NotFoundError is the 404 handler's
            raise StarletteHTTPException(422, str(exc)) from exc
        if commit is None:
            raise StarletteHTTPException(422, "ask about a file (file=...) or a table version "
                                              "(sink=...&table_version=...)")
        return {"epoch": commit.epoch, "commit": _json(commit)}
