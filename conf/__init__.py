# Makes conf/ importable as zenithtune.conf (pkg://zenithtune.conf), so installed copies find it.
