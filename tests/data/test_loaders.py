import gzip
import os

import numpy as np
import pytest

from fastopt.data import TemporalGraph, builtin_datasets, load_dataset, load_file, save_npz
from fastopt.errors import DataError, FastOptError

SHARED = {
    # file: (events, nodes, bipartite, edge_dim)
    "wikipedia.csv.gz": (157_474, 9_227, True, 0),
    "email-Eu-core-temporal.txt.gz": (332_334, 986, False, 0),
    "CollegeMsg.txt.gz": (59_835, 1_899, False, 0),
    "sociopatterns-SFHH.txt.gz": (1_417_485, 403, False, 0),
    "CanParl.csv.gz": (74_478, 734, False, 1),
}


@pytest.mark.parametrize("name", sorted(SHARED))
def test_shared_files_load(shared_data, name):
    events, nodes, bipartite, edge_dim = SHARED[name]
    g = load_dataset(shared_data / name)
    assert (g.num_events, g.num_nodes, g.bipartite, g.edge_dim) == (events, nodes, bipartite, edge_dim)
    assert (np.diff(g.ts) >= 0).all()
    assert g.src.max() < g.num_nodes and g.dst.max() < g.num_nodes
    assert set(np.unique(np.r_[g.src, g.dst])) == set(range(g.num_nodes))  # dense ids


def test_builtin_wikipedia_resolves_by_name(wikipedia):
    assert "wikipedia" in builtin_datasets()
    assert wikipedia.num_events == 157_474 and wikipedia.bipartite
    assert wikipedia.labels is not None and int(wikipedia.labels.sum()) == 217
    # destination ids 8227..9226 are already offset in the file and stay there
    assert wikipedia.dst.min() == 8227 and wikipedia.dst.max() == 9226


def test_builtin_email_eu_core_resolves_by_name():
    """The second shipped graph (SNAP email-Eu-core-temporal): directed, 986 nodes, many repeated
    pairs; the file is the shared one, byte for byte."""
    assert sorted(builtin_datasets()) == ["email-eu-core", "wikipedia"]
    g = load_dataset("email-eu-core")
    assert (g.num_events, g.num_nodes, g.bipartite, g.edge_dim) == (332_334, 986, False, 0)


def write(path, text, compress=False):
    data = text.encode()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def test_jodie_csv_with_features_is_bipartite_and_sorted(tmp_path):
    f = write(tmp_path / "j.csv", "u,i,ts,label,f0,f1\n5,0,3,0,0.5,1\n7,0,1,1,2,3\n5,2,2,0,4,5\n")
    g = load_file(f, cache=False)
    # users {5,7} -> 0,1 ; items {0,2} -> 2,3 ; sorted by time
    np.testing.assert_array_equal(g.src, [1, 0, 0])
    np.testing.assert_array_equal(g.dst, [2, 3, 2])
    np.testing.assert_array_equal(g.ts, [1, 2, 3])
    np.testing.assert_array_equal(g.labels, [1, 0, 0])
    np.testing.assert_allclose(g.edge_feat, [[2, 3], [4, 5], [0.5, 1]])
    assert g.bipartite and g.num_nodes == 4


def test_tgl_edges_csv(tmp_path):
    write(tmp_path / "edges.csv", ",src,dst,time,ext_roll\n0,10,20,0,0\n1,20,30,5,0\n2,10,30,5,1\n")
    g = load_dataset(tmp_path)  # a directory with edges.csv
    np.testing.assert_array_equal(g.src, [0, 1, 0])
    np.testing.assert_array_equal(g.dst, [1, 2, 2])
    assert g.edge_feat is None and not g.bipartite


def test_dgb_csv_weight_is_edge_feature(tmp_path):
    f = write(tmp_path / "d.csv", "source,destination,timestamp,state_label,w\n1,2,0.0,0,6\n2,3,1.0,0,7\n")
    g = load_file(f, cache=False)
    np.testing.assert_allclose(g.edge_feat[:, 0], [6, 7])


def test_snap_and_sociopatterns_time_column_detected(tmp_path):
    snap = load_file(write(tmp_path / "s.txt", "1 2 100\n3 1 50\n2 3 200\n"), cache=False)
    np.testing.assert_array_equal(snap.ts, [50, 100, 200])
    # time first and sorted; third column not sorted
    socio = load_file(write(tmp_path / "p.txt", "20 7 9\n40 9 3\n40 3 8\n"), cache=False)
    np.testing.assert_array_equal(socio.ts, [20, 40, 40])
    np.testing.assert_array_equal(socio.src, [1, 3, 0])  # ids {3,7,8,9} -> 0..3


def test_gzip_detected_by_content_not_extension(tmp_path):
    f = write(tmp_path / "plain.txt", "1 2 3\n2 1 4\n", compress=True)
    assert load_file(f, cache=False).num_events == 2


@pytest.fixture
def cache_dir(tmp_path):
    """This test's own dataset cache."""
    from fastopt.config import patch

    with patch(data__cache_dir=str(tmp_path / "cache")):
        yield tmp_path / "cache"


def test_npz_roundtrip_and_cache(tmp_path, small_graph, cache_dir):
    out = tmp_path / "g.npz"
    save_npz(small_graph, out)
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as any new file, not mkstemp's 0600
    g = load_file(out)
    np.testing.assert_array_equal(g.src, small_graph.src)
    np.testing.assert_array_equal(g.edge_feat, small_graph.edge_feat)
    f = write(tmp_path / "c.txt", "1 2 3\n2 1 4\n")
    load_file(f)
    assert list(cache_dir.glob("c.txt.*.npz")), "parsed graph was not cached"
    assert not list(tmp_path.glob("c.txt.*")), "a file was written beside the source"
    assert load_file(f).num_events == 2  # served from the cache


@pytest.mark.parametrize("damage", ["truncated", "altered", "foreign"])
def test_a_bad_cache_entry_is_reported_and_rebuilt(tmp_path, damage, cache_dir):
    f = write(tmp_path / "c.txt", "1 2 3\n2 1 4\n3 1 5\n")
    parsed = load_file(f)
    (entry,) = cache_dir.glob("c.txt.*.npz")
    good = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(good[: len(good) // 2])
    elif damage == "altered":  # a valid .npz whose arrays no longer hash to the recorded sum
        with np.load(entry) as z:
            arrays = {k: z[k] for k in z.files}
        arrays["dst"] = arrays["dst"][::-1].copy()
        np.savez(entry, **arrays)
    else:  # a whole, valid .npz of another graph under this source's name
        save_npz(TemporalGraph(np.array([0]), np.array([1]), np.zeros(1), num_nodes=2), entry)
    with pytest.warns(RuntimeWarning, match=f"dataset cache entry {entry} is not used"):
        again = load_file(f)
    np.testing.assert_array_equal(again.dst, parsed.dst)
    assert again.num_events == 3
    assert entry.read_bytes() == good  # rewritten whole, and served silently from now on
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_file(f)


def test_an_altered_npz_is_refused(tmp_path, small_graph):
    out = tmp_path / "g.npz"
    save_npz(small_graph, out)
    with np.load(out) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["ts"] = arrays["ts"] + 1.0
    np.savez(out, **arrays)
    with pytest.raises(DataError, match="does not match its content hash"):
        load_file(out)


def test_random_features_are_deterministic(small_graph):
    a = load_dataset("wikipedia", edge_dim=16, seed=3)
    b = load_dataset("wikipedia", edge_dim=16, seed=3)
    c = load_dataset("wikipedia", edge_dim=16, seed=4)
    assert a.edge_feat.shape == (157_474, 16) and a.node_feat is None
    np.testing.assert_array_equal(a.edge_feat, b.edge_feat)
    assert not np.array_equal(a.edge_feat, c.edge_feat)


@pytest.mark.parametrize("text,fragment", [
    ("", "empty"),
    ("u,i,ts\n", "no events"),
    ("1 2 nan\n2 1 3\n", "finite"),
    ("1 2 -inf\n", "finite"),
    ("1.5 2 3\n", "not an integer"),
    ("1 2 3\n1 2\n", "columns"),
    ("a b c\nx y z\n", "not numeric"),
    ("foo,bar,baz\n1,2,3\n", "names no"),
    ("1 2\n", "at least src, dst and time"),
    ("9007199254740993 2 3\n", "beyond 2\\*\\*53"),
])
def test_bad_files_raise_fastopt_error(tmp_path, text, fragment):
    f = write(tmp_path / "bad.txt", text)
    with pytest.raises(DataError, match=fragment):
        load_file(f, cache=False)


def test_unknown_dataset_and_binary_file(tmp_path):
    with pytest.raises(FastOptError, match="neither a built-in dataset"):
        load_dataset("no-such-dataset")
    f = tmp_path / "bin.dat"
    f.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(DataError, match="not a text event file"):
        load_file(f, cache=False)


def test_graph_validation():
    with pytest.raises(DataError, match="outside"):
        TemporalGraph(np.array([0, 5]), np.array([1, 1]), np.array([0.0, 1.0]), num_nodes=3)
    with pytest.raises(DataError, match="not sorted"):
        TemporalGraph(np.array([0, 1]), np.array([1, 0]), np.array([2.0, 1.0]), num_nodes=2)
    with pytest.raises(DataError, match="finite"):
        TemporalGraph(np.array([0]), np.array([1]), np.array([np.nan]), num_nodes=2)


def test_chronological_split_and_inductive_mask():
    ts = np.repeat(np.arange(10.0), 10)  # 100 events, 10 per timestamp
    src = np.arange(100) % 7
    dst = 7 + np.arange(100) % 5
    dst[95:] = 12  # node 12 appears only in the last events
    g = TemporalGraph(src, dst, ts, num_nodes=13)
    assert g.train_end == 70 and g.val_end == 90  # quantiles fall on timestamp boundaries
    assert g.ts[g.train_end - 1] < g.ts[g.train_end]
    assert g.split_range("test") == range(90, 100)
    ind = g.inductive_mask("test")
    np.testing.assert_array_equal(ind, np.r_[np.zeros(5, bool), np.ones(5, bool)])
    with pytest.raises(DataError, match="unknown split"):
        g.split_range("dev")


def test_info_reports_repeat_rate():
    g = TemporalGraph(np.array([0, 0, 1, 0]), np.array([1, 1, 2, 1]), np.arange(4.0), num_nodes=3)
    info = g.info()
    assert info["repeat_rate"] == pytest.approx(0.5)
    assert info["events"] == 4 and info["degree_max"] == 4


def test_pyg_roundtrip(small_graph):
    pytest.importorskip("torch_geometric")
    back = TemporalGraph.from_pyg(small_graph.to_pyg(), num_nodes=small_graph.num_nodes)
    np.testing.assert_array_equal(back.src, small_graph.src)
    np.testing.assert_array_equal(back.edge_feat, small_graph.edge_feat)


def test_dataset_cache_folder_and_an_unwritable_one(tmp_path, monkeypatch):
    from fastopt.config import patch
    from fastopt.data import dataset_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with patch(data__cache_dir=""):
        assert dataset_cache_dir() == tmp_path / "xdg" / "fastopt" / "datasets"
        monkeypatch.delenv("XDG_CACHE_HOME")
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        assert dataset_cache_dir() == tmp_path / "home" / ".cache" / "fastopt" / "datasets"
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    f = write(tmp_path / "s.txt", "1 2 3\n2 1 4\n")
    with patch(data__cache_dir=str(blocked / "cache")):
        with pytest.warns(RuntimeWarning, match="cannot be written.*FASTOPT_DATA_CACHE_DIR"):
            assert load_file(f).num_events == 2  # parsed all the same


def test_the_suite_writes_no_cache_beside_the_data(shared_data, dataset_cache):
    before = sorted(shared_data.iterdir())
    load_dataset(shared_data / "CollegeMsg.txt.gz")
    assert sorted(shared_data.iterdir()) == before and list(dataset_cache.glob("CollegeMsg.txt.gz.*.npz"))
    package = builtin_datasets()["wikipedia"].parent
    before = sorted(package.iterdir())
    load_dataset("wikipedia")
    assert sorted(package.iterdir()) == before and list(dataset_cache.glob("wikipedia.csv.gz.*.npz"))