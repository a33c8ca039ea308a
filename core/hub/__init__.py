"""Hugging Face Hub sources and destinations: pin, fetch what a merge needs, publish.

The engine never imports this package: it sees local directories. The service pins sources at
submit time (pin.py); a worker fetches into a cache keyed by commit sha (fetch.py) and publishes
outputs (publish.py). Tokens come from named credentials (credentials.py) and go nowhere else.
Every request to the Hub is bounded (timeouts.py): a stuck Hub fails with hub_timeout.
"""
