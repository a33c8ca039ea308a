"""The API process assembled: the FastAPI app (service/) with the executor settings name, from
the job runtime (worker/): jobs run on a thread of this process (`local`, the embedded default)
or are sent to Celery workers (`celery`)."""

from __future__ import annotations

from fastapi import FastAPI

from core.db.session import Database
from core.settings import Settings
from service.app import create_app
from worker.executors import make_executor


def build_app(settings: Settings) -> FastAPI:
    """The app with the executor `settings.executor` names; it shares the app's database."""
    db = Database(settings.database)
    return create_app(settings, executor=make_executor(db, settings), db=db)


def app_from_environment() -> FastAPI:
    """The app from LAYERSWAP_* alone: what each process of `layerswap serve --workers N` runs
    (the schema is migrated once, by `serve`, before they start)."""
    return build_app(Settings())
