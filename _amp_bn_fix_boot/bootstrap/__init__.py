"""The folder ``amp-bn-fix run`` puts first on ``PYTHONPATH``; only its sitecustomize matters."""
