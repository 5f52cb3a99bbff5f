"""Helpers the tests share: tiny models, fixtures, rank-side worker code and reference implementations,
one concern per module, imported as `from tests.helpers.<module> import ...`."""
