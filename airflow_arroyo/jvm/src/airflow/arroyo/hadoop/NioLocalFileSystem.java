/*
 * airflow-arroyo: Hadoop's LocalFileSystem (checksummed, as `file:` is by default) over NioRawLocalFileSystem.
 * Spark uses it for `file:` paths when `spark.hadoop.fs.file.impl` names it (airflow_arroyo.jvm).
 *
 * It also loads RocksDB's SST files without copying them: Spark's RocksDB state store loads a version by copying
 * each SST file of the checkpoint into the store's local working folder (RocksDBFileManager, through
 * copyToLocalFile), the whole state after a restart or a restore. An SST file is immutable on both sides (the
 * checkpoint's copy has a name of its own that is never written again, and RocksDB never writes into an SST file
 * it has closed; both sides delete by unlinking), so where both are on one local file system the working copy is
 * a hard link to the checkpoint's file. Anything else, or where a link cannot be made (another device, no hard
 * links), is copied as before; the system property airflow.arroyo.linkSstFiles=false turns links off.
 */
package airflow.arroyo.hadoop;

import java.io.File;
import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.LinkOption;

import org.apache.hadoop.fs.LocalFileSystem;
import org.apache.hadoop.fs.Path;

public class NioLocalFileSystem extends LocalFileSystem {
  public static final String LINK_SST_FILES = "airflow.arroyo.linkSstFiles";

  public NioLocalFileSystem() {
    super(new NioRawLocalFileSystem());
  }

  @Override
  public void copyToLocalFile(Path src, Path dst) throws IOException {
    if (src.getName().endsWith(".sst") && link(src, dst)) {
      return;
    }
    // Hadoop's copy opens an existing destination and truncates it in place: where that file is a link, the
    // bytes of the file it shares (a checkpoint's, a snapshot object's) would change. Unlink it first.
    java.nio.file.Path local = localPath(dst);
    if (local != null && Files.isRegularFile(local, LinkOption.NOFOLLOW_LINKS)) {
      Files.delete(local);
    }
    super.copyToLocalFile(src, dst);
  }

  private static java.nio.file.Path localPath(Path dst) {
    String scheme = dst.toUri().getScheme();
    return scheme == null || scheme.equals("file") ? new File(dst.toUri().getPath()).toPath() : null;
  }

  /** Hard-link the local file dst to src; false where that cannot be done (the caller copies). */
  private boolean link(Path src, Path dst) {
    if (!Boolean.parseBoolean(System.getProperty(LINK_SST_FILES, "true"))) {
      return false;
    }
    java.nio.file.Path to = localPath(dst);
    if (to == null) {
      return false;
    }
    try {
      java.nio.file.Path from = pathToFile(makeQualified(src)).toPath();
      if (!Files.isRegularFile(from, LinkOption.NOFOLLOW_LINKS)) {
        return false;
      }
      if (Files.exists(to, LinkOption.NOFOLLOW_LINKS)) {
        if (Files.isSameFile(from, to)) {
          return true;  // linked before: nothing to do
        }
        return false;  // the caller unlinks it and copies
      }
      java.nio.file.Path parent = to.getParent();
      if (parent != null) {
        Files.createDirectories(parent);
      }
      Files.createLink(to, from);
      return true;
    } catch (IOException | UnsupportedOperationException | SecurityException | IllegalArgumentException e) {
      return false;  // another device, a file system without hard links, ...: copied instead
    }
  }
}
