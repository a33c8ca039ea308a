"""Where a job's inputs come from: local sources under the tenant's allowed roots, Hub sources
fetched into the cache as the job's `downloading` stage."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.db.models import Job
from core.hub.credentials import token_for
from core.hub.fetch import fetch_inputs
from core.hub.refs import hub_sources
from core.settings import Settings
from core.sources import resolve_source
from worker.lease import JobLease


def local_resolver(job: Job, settings: Settings) -> Callable[[str], Path]:
    return lambda source: resolve_source(source, settings, job.tenant_id)


def fetch_hub_inputs(job: Job, recipe: Any, settings: Settings, lease: JobLease) -> Any:
    """FetchedInputs for the recipe's Hub sources (None without any), the download being the
    job's `downloading` stage; the caller closes it."""
    if not hub_sources(recipe):
        return None
    return fetch_inputs(
        recipe,
        cache_dir=settings.cache_dir / "hub",
        token=token_for(
            recipe.credential, tenant=job.tenant_id, credentials=settings.hub_credentials
        ),
        local=local_resolver(job, settings),
        on_progress=lease.stage_progress("downloading"),
        should_cancel=lease.should_cancel,
    )
