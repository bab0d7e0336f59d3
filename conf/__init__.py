# Makes conf/ importable as zenithtune.conf (pkg://zenithtune.conf), so installed copies find it.
# Importing it registers the schema conf/config.yaml names first in its defaults list.
import zenithtune.settings  # noqa: E402,F401
