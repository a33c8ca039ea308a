"""The webhook outbox (events queued in a job's own transaction) and signing secrets at rest;
delivery and the endpoints API are the service's (service/webhooks/)."""
