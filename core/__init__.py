"""What the API (service/) and the job runtime (worker/) share, with no web framework and no
Celery: settings, the store (db/), job kinds and their records (jobs, lineage, evaluations),
sources, quotas, integrations, the webhook outbox, the Hub and lm-eval libraries. Imports the
engine only."""
