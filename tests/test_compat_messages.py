"""compat's messages say the rank once: "rank R: WHAT: DETAIL" (docs/compat.md, "Errors")."""

import pytest

from flagcx_mesh import compat

pytestmark = pytest.mark.timeout(60)


def test_a_failed_init_names_its_rank_once():
    uid = compat.get_unique_id()  # rank 0 never joins: rank 1's build times out
    with pytest.raises(compat.FlagcxError) as err:
        compat.comm_init_rank(2, uid, 1, timeout=1)
    text = str(err.value)
    assert text.startswith("rank 1: comm_init_rank(nranks=2): "), text
    assert text.count("rank 1:") == 1, text
    assert "never joined" in text, text
