"""The document-result aggregator: descriptions + dead letters in, one DocumentResult per document out.

A document is complete when every image index in ``range(image_count)`` has a description or a dead
letter (a description wins over a dead letter of the same image: a redriven image may succeed later). A record
with another image count, or another source URI at an index, is a newer version of the document (the producer
republished it changed) and replaces what the result said.
A dead letter with a doc_id but no image_index is a document-level failure (the decode stage could not
read the document): it completes the document at once, every image without an outcome is marked failed
with that error, and the error is kept in ``metadata["document_error"]``. When such a failure does not say
how many images the document has, ``image_count`` is the number of images seen so far (often 0): the
result still exists, and ``metadata["document_error"]`` says why it is empty.

State survives restarts without an external store. Per (topic, partition) the committed offset never
passes the first record of a document that is still open, so a restart re-reads and rebuilds it. A
document already emitted also holds the commit back while any of its records would be re-read, so a
restart never rebuilds half of a finished document (it would stay open forever); the price is that a
crash can emit a document's result twice (topic ``results`` is compacted by doc_id: the copies agree).

Exactly-once (``infer.exactly_once``): a finished document's result is held back until the commit point has passed
every record of it, and then goes out in the Kafka transaction that commits that point (``Checkpoint
.commit_transaction``: results, their dead letters and the consumed offsets, all or nothing). A restart rebuilds
only documents whose results no committed transaction carries, so a read_committed reader sees each result once.
The price is latency: a finished document waits for the open documents below it on the partitions they share (at
most ``open_timeout_s``). Only the owner of the partitions holds a transactional producer, with one
transactional id per group (``results_transactional_id``): a new owner's ``init_transactions`` fences the last one
(a process killed or stopped mid-transaction: its open transaction is aborted, its later commits refused) and only
then reads the committed offsets to rebuild from. A transaction that fails mid-run (fenced, the group moved on, the
cluster slow) ends the ownership term: its results were never visible, the state is dropped and rebuilt from the
committed offsets by the next term, which may be this process's again.

Late records (a duplicate from at-least-once redelivery, a redriven image, a late dead letter) can arrive after a
document left memory (``_docs``, then the ``recent_docs`` LRU). Such a record would open the document again with
that one image, and ``open_timeout_s`` later a partial result would replace the complete one in the compacted topic.
So every emitted result leaves a compact record (``documents.EmittedResult``: image count, a 4-byte hash of each
image's source URI, the set of indexes that succeeded) in a second LRU of ``emitted_docs`` entries (200,000 by
default, about 50 MB), and:

* a record of the same version (same image count, no other source URI at a known index) that cannot add a success
  (a description of an image that already succeeded, by the model that described the result; any dead letter) is
  dropped before it opens the document;
* a result of the same version that lacks a success already emitted is never sent (``stats.stale``); a redriven
  success of a document forgotten this way is kept out too (the old result stays);
* another image count or another source URI at an index is a newer version: it is emitted, and replaces the record.

A description by another model than the one that described an image before is a replay with that model (topics
replayed into an inference group running a new checkpoint): it replaces that image's entry and the result is sent
again. A document still in memory is re-sent as each image's new description arrives (the compacted topic keeps the
last); a forgotten one opens again and is sent once every image has an outcome again (a partial one times out as
stale, above, and the old result stays).

The record does not survive a restart (nor, exactly-once, the end of an ownership term): after one, a late record
of a document emitted before it can still produce a partial result ``open_timeout_s`` later (reading the compacted
results topic back would close that window).

Descriptions and dead letters are keyed by doc_id, but the dead-letter topic usually has fewer
partitions, so one document's records are spread over two partitions that no assignor can co-locate.
The group therefore gives every partition to one member (``SingleOwnerAssignor``); other members are
hot standbys. Aggregation is JSON parsing of small records, far from being a bottleneck.

Modules: ``documents`` (one document's state, when it is complete, the result record it makes; no Kafka),
``aggregator`` (``ResultsAggregator``: the Kafka clients, commit points, ownership terms), ``ownership`` (the group,
its single owner, the owner's transactional id), ``metrics`` (the aggregator's stats for Prometheus).
"""
