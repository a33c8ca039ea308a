"""Integrations with systems outside the service: OpenLineage (lineage backends)."""
