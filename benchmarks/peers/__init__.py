"""dualkv beside the other shared-prefix methods (PrefixGrouper, TRL's prefix tree, flash-pref): one model, one batch,
one process; peers_rows.sh runs the rows."""
