"""What producers, the decode stage and the inference side share about images: the images topic's payload format
(`payload`), the claim-check store for payloads over the record limit, page selectors and counts of multi-page
files, the TurboJPEG handle, and the bytes a URI names (`fetch`; local paths through `localfiles`). No Kafka here."""
