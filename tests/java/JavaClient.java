// A Kafka client nobody on the team wrote: Apache Kafka's own Java client, run as a single-file program
// (`java -cp "<kafka jars>/*" JavaClient.java ...`). Tests use it to publish into the pipeline's topics the way a
// JVM service would (its compression codecs, its headers) and to read the pipeline's outputs back.
//
//   produce BOOTSTRAP TOPIC COMPRESSION   stdin: one record per line, "key<TAB>value"; prints "sent N"
//   consume BOOTSTRAP TOPIC COUNT TIMEOUT_MS   read_committed from the beginning; prints one line per record:
//                                              "key<TAB>header-keys (comma-separated)<TAB>value length"
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Properties;
import java.util.UUID;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.StringDeserializer;
import org.apache.kafka.common.serialization.StringSerializer;

public class JavaClient {
    public static void main(String[] args) throws Exception {
        if (args[0].equals("produce")) {
            produce(args[1], args[2], args[3]);
        } else {
            consume(args[1], args[2], Integer.parseInt(args[3]), Long.parseLong(args[4]));
        }
    }

    static void produce(String bootstrap, String topic, String compression) throws Exception {
        Properties props = new Properties();
        props.put("bootstrap.servers", bootstrap);
        props.put("compression.type", compression);
        props.put("linger.ms", "50");  // several records per batch, so a compressed batch holds more than one
        props.put("key.serializer", StringSerializer.class.getName());
        props.put("value.serializer", StringSerializer.class.getName());
        int sent = 0;
        try (KafkaProducer<String, String> producer = new KafkaProducer<>(props);
             BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8))) {
            String line;
            while ((line = in.readLine()) != null) {
                if (line.isEmpty()) continue;
                int tab = line.indexOf('\t');
                ProducerRecord<String, String> record = new ProducerRecord<>(topic, line.substring(0, tab), line.substring(tab + 1));
                record.headers().add("producer", "java".getBytes(StandardCharsets.UTF_8));
                producer.send(record);
                sent++;
            }
            producer.flush();
        }
        System.out.println("sent " + sent);
    }

    static void consume(String bootstrap, String topic, int count, long timeoutMs) {
        Properties props = new Properties();
        props.put("bootstrap.servers", bootstrap);
        props.put("group.id", "java-client-" + UUID.randomUUID());
        props.put("auto.offset.reset", "earliest");
        props.put("isolation.level", "read_committed");
        props.put("enable.auto.commit", "false");
        props.put("key.deserializer", StringDeserializer.class.getName());
        props.put("value.deserializer", ByteArrayDeserializer.class.getName());
        int seen = 0;
        long deadline = System.currentTimeMillis() + timeoutMs;
        try (KafkaConsumer<String, byte[]> consumer = new KafkaConsumer<>(props)) {
            consumer.subscribe(List.of(topic));
            while (seen < count && System.currentTimeMillis() < deadline) {
                for (ConsumerRecord<String, byte[]> record : consumer.poll(Duration.ofMillis(200))) {
                    List<String> keys = new ArrayList<>();
                    for (Header header : record.headers()) keys.add(header.key());
                    System.out.println(record.key() + "\t" + String.join(",", keys) + "\t" + record.value().length);
                    seen++;
                }
            }
        }
        System.out.flush();
    }
}
