"""What a recipe is made of: the blocks every method's schema shares (sources, output options,
destinations), settings that vary by layer (gradients and filters), what is said of each of a
method's params (params.py: type, default, bounds, per model, varying by layer), and YAML read
from a user with bounds. Pydantic only: importable without torch, as the API validates recipes.
Imports nothing of the engine but its errors and limits."""
