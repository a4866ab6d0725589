# Makes the module at the repository root importable from tests/ (pytest rootdir conftest).
