"""Web console templates (rendered by kmend/api/console.py)."""
